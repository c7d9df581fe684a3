"""The rescore pipeline's compiled IR: an importer of the train task's rollouts Dataset feeding the rescore step
(its local run on a real train task's artifact is in test_local_run.py)."""

from __future__ import annotations

import pytest
import yaml
from google.protobuf import json_format
from kfp.pipeline_spec import pipeline_spec_pb2 as pb


def test_the_rescore_pipeline_imports_the_rollouts_dataset_into_its_step(tmp_path):
    from dockrl.pipelines.rescore import compile_rescore

    path = compile_rescore(tmp_path / "rescore.yaml")
    spec = json_format.ParseDict(yaml.safe_load(path.read_text()), pb.PipelineSpec(), ignore_unknown_fields=False)
    assert spec.pipeline_info.name == "dockrl-rescore"
    params = spec.root.input_definitions.parameters
    assert {k: params[k].parameter_type for k in params} == {"rollouts_uri": pb.ParameterType.STRING, "scorer": pb.ParameterType.STRING,
                                                                 "judge": pb.ParameterType.STRING}
    tasks = spec.root.dag.tasks
    assert set(tasks) == {"importer", "rescore-rollouts"}
    importer = spec.deployment_spec["executors"]["exec-importer"]["importer"]
    assert importer["artifactUri"] == {"runtimeParameter": "uri"} and importer["typeSchema"]["schemaTitle"] == "system.Dataset"
    assert "reimport" not in importer  # the train task's artifact itself: its lineage, not a copy
    source = tasks["rescore-rollouts"].inputs.artifacts["rollouts"].task_output_artifact
    assert (source.producer_task, source.output_artifact_key) == ("importer", "artifact")
    outputs = spec.components["comp-rescore-rollouts"].output_definitions.artifacts
    assert {k: outputs[k].artifact_type.schema_title for k in outputs} == {"rescored": "system.Dataset", "metrics": "system.Metrics"}
    with pytest.raises(ValueError, match="expected a .yaml or .json file name"):
        compile_rescore(tmp_path / "rescore.txt")


def test_a_local_rescore_of_a_folder_that_is_not_there_names_it(tmp_path):
    from dockrl.pipelines.rescore import run_rescore_local

    with pytest.raises(FileNotFoundError, match=r"rollouts_uri .*missing: no such folder"):
        run_rescore_local(tmp_path / "missing", "fake_scorers:FakeDigitScorer", tmp_path / "root")
