"""The SFT pipeline and the alignment pipeline (SFT → GRPO), beside the GRPO one (``pipelines/grpo.py``).

    dockrl pipeline compile sft.yaml --kind sft --platform npu
    dockrl pipeline compile alignment.yaml --kind alignment --platform gpu
    dockrl pipeline run --local --kind alignment --sft-override sft.epochs=2 trainer.iterations=2

* ``dockrl-sft``: resolve-config → prepare-dataset → sft → export-model → evaluate, the workers (evaluate's, with
  the kubernetes backend) torn down on exit.
* ``dockrl-alignment``: resolve-config of each phase → prepare-dataset → sft → start-from → train (GRPO) →
  export-model → evaluate, the workers torn down on exit as in the GRPO pipeline. The GRPO phase starts from
  the SFT step's model: ``start-from`` (``components/start_from.py``) takes the sft task's ``model`` artifact,
  which names the final SFT checkpoint on the shared volume (or holds it), and sets ``model.path`` of the GRPO
  phase's overrides to it, so the run's lineage links the GRPO run to the SFT model it started from.

The sft task runs ``dockrl sft`` in its own pod on one of the platform's accelerators with either worker backend
(``configure_sft``); both phases read the one prepared dataset (GSM8K rows: SFT trains on their worked answers,
GRPO on their final answers). Parameters: those of the GRPO pipeline for the GRPO phase (the alignment
pipeline), ``model_path``, ``train_data``, ``test_data`` and ``keep_checkpoints`` for both phases,
``config_overrides`` (the SFT pipeline's; the alignment pipeline's GRPO phase) and ``sft_config_overrides``
(the alignment pipeline's SFT phase), and the export's. Compile-time settings are the GRPO pipeline's
(``PipelineSettings``). Nothing is compiled at import.
"""

# no `from __future__ import annotations`: kfp reads the pipeline's parameter types at runtime
from kfp import dsl, kubernetes

from dockrl.components.sft import sft
from dockrl.components.start_from import start_from
from dockrl.components.teardown_workers import teardown_workers
from dockrl.kubeflow.steps import run_parameter_defaults
from dockrl.pipelines.grpo import (
    PipelineSettings,
    configure_sft,
    dataset_step,
    export_and_evaluate,
    place_task,
    reads_run_inputs,
    resolve_step,
    train_step,
)

SFT_PIPELINE_NAME = "dockrl-sft"
ALIGNMENT_PIPELINE_NAME = "dockrl-alignment"


def teardown_step(s: PipelineSettings) -> dsl.PipelineTask:
    """The exit task that tears the run's worker groups down, whatever happened (as the GRPO pipeline's)."""
    teardown = teardown_workers(run_id=dsl.PIPELINE_JOB_ID_PLACEHOLDER, worker_backend=s.worker_backend)
    teardown.set_caching_options(False)
    place_task(teardown, "teardown-workers", s)
    kubernetes.use_field_path_as_env(teardown, env_name="POD_NAMESPACE", field_path="metadata.namespace")
    return teardown


def sft_step(s: PipelineSettings, resolved: dsl.PipelineTask, data: dsl.PipelineTask) -> dsl.PipelineTask:
    """The sft task on ``data``'s dataset with ``resolved``'s overrides, sized by it."""
    tuned = sft(config_overrides=resolved.outputs["overrides"], dataset=data.outputs["dataset"], run_id=dsl.PIPELINE_JOB_ID_PLACEHOLDER,
                platform=s.platform.to_json())
    place_task(tuned, "sft", s)
    configure_sft(tuned, s, resolved)
    return tuned


def build_sft_pipeline(settings: PipelineSettings):
    """The SFT pipeline for ``settings``."""
    s, p = settings, run_parameter_defaults()
    config = dsl.PipelineConfig(ttl_seconds_after_finished=s.ttl_after_finished_s or None)

    @dsl.pipeline(name=SFT_PIPELINE_NAME, pipeline_config=config,
                  description=f"Supervised fine-tuning on the assistant's tokens ({s.platform.name})")
    def sft_pipeline(
        model_path: str = p["model_path"],
        train_data: str = p["train_data"],
        test_data: str = p["test_data"],
        keep_checkpoints: int = p["keep_checkpoints"],
        config_overrides: str = "",
        export_dtype: str = "bfloat16",
        copy_model: bool = False,
        export_uri: str = "",
    ):
        """Supervised fine-tuning (dockrl sft), then export and greedy evaluation of the model.

        Args:
            model_path: The model SFT starts from: a folder on the shared volume, an s3:// URI, or smollm2-135m (model.path).
            train_data: Training examples (JSONL or Parquet: chat messages, prompt/completion, or GSM8K question/answer):
                a path on the shared volume or an s3:// URI; empty: seeded generated problems (data.train_path).
            test_data: Evaluation prompts in GSM8K format; empty: a seeded held-out split (data.test_path).
            keep_checkpoints: Newest intermediate checkpoints kept besides the final one; 0 keeps all (trainer.keep_checkpoints).
            config_overrides: Any other config field, one section.field=value per line, e.g. sft.epochs=2.
            export_dtype: dtype of the exported model: bfloat16, float16 or float32.
            copy_model: Also put the exported model's weights into KFP's artifact store.
            export_uri: s3://<bucket>/<key> to put the exported model in the object store; empty: the shared volume.
        """
        with dsl.ExitHandler(teardown_step(s), name="sft-run"):  # evaluate's worker group with the kubernetes backend
            resolved = resolve_step(s, p, config_overrides, model_path=model_path, train_data=train_data, test_data=test_data,
                                    keep_checkpoints=keep_checkpoints)
            data = dataset_step(s, resolved.outputs["overrides"])
            tuned = sft_step(s, resolved, data)
            export_and_evaluate(s, tuned.outputs["model"], data, resolved.outputs["overrides"], export_dtype=export_dtype,
                                copy_model=copy_model, export_uri=export_uri)

    return sft_pipeline


def build_alignment_pipeline(settings: PipelineSettings):
    """The alignment pipeline (SFT → GRPO) for ``settings``."""
    s, p = settings, run_parameter_defaults()
    config = dsl.PipelineConfig(ttl_seconds_after_finished=s.ttl_after_finished_s or None)

    @dsl.pipeline(name=ALIGNMENT_PIPELINE_NAME, pipeline_config=config,
                  description=f"SFT, then GRPO from the SFT model ({s.platform.name}, {s.worker_backend} workers)")
    def alignment(
        iterations: int = p["iterations"],
        global_batch: int = p["global_batch"],
        mini_batch: int = p["mini_batch"],
        group_size: int = p["group_size"],
        learning_rate: float = p["learning_rate"],
        kl_loss_coef: float = p["kl_loss_coef"],
        max_response_length: int = p["max_response_length"],
        adv_estimator: str = p["adv_estimator"],
        model_path: str = p["model_path"],
        train_data: str = p["train_data"],
        test_data: str = p["test_data"],
        keep_checkpoints: int = p["keep_checkpoints"],
        sft_config_overrides: str = "",
        config_overrides: str = "",
        export_dtype: str = "bfloat16",
        copy_model: bool = False,
        export_uri: str = "",
    ):
        """SFT, then GRPO from the SFT model through the transfer dock, then export and greedy evaluation.

        Args:
            iterations: GRPO iterations (trainer.iterations).
            global_batch: GRPO prompts per iteration (trainer.global_batch).
            mini_batch: GRPO prompts per optimizer step (trainer.mini_batch).
            group_size: Responses sampled per prompt (rollout.n).
            learning_rate: GRPO's AdamW learning rate (trainer.lr); SFT's is sft_config_overrides' trainer.lr.
            kl_loss_coef: Weight of GRPO's KL penalty to its reference, the SFT model (algorithm.kl_loss_coef).
            max_response_length: Most generated tokens per response (rollout.max_response_length).
            adv_estimator: GRPO's advantage estimator (algorithm.adv_estimator).
            model_path: The model SFT starts from: a folder on the shared volume, an s3:// URI, or smollm2-135m (model.path).
            train_data: Training data of both phases, GSM8K format (SFT on the worked answers); empty: generated problems.
            test_data: Evaluation prompts; empty: a seeded held-out split; champ: the CHAMP problems (data.test_path).
            keep_checkpoints: Newest intermediate checkpoints each phase keeps besides its final one (trainer.keep_checkpoints).
            sft_config_overrides: The SFT phase's other config fields, one section.field=value per line, e.g. sft.epochs=2
                and trainer.lr=2e-5.
            config_overrides: The GRPO phase's other config fields, one per line; they win over the parameters above.
            export_dtype: dtype of the exported model: bfloat16, float16 or float32.
            copy_model: Also put the exported model's weights into KFP's artifact store.
            export_uri: s3://<bucket>/<key> to put the exported model in the object store; empty: the shared volume.
        """
        with dsl.ExitHandler(teardown_step(s), name="alignment-run"):
            shared = dict(model_path=model_path, train_data=train_data, test_data=test_data, keep_checkpoints=keep_checkpoints)
            resolved_sft = resolve_step(s, p, sft_config_overrides, **shared)
            resolved = resolve_step(
                s, p, config_overrides, iterations=iterations, global_batch=global_batch, mini_batch=mini_batch, group_size=group_size,
                learning_rate=learning_rate, kl_loss_coef=kl_loss_coef, max_response_length=max_response_length,
                adv_estimator=adv_estimator, **shared)
            data = dataset_step(s, resolved_sft.outputs["overrides"])
            tuned = sft_step(s, resolved_sft, data)
            started = start_from(config_overrides=resolved.outputs["overrides"], model=tuned.outputs["model"])
            place_task(started, "start-from", s)
            reads_run_inputs(started, s.platform)  # the SFT model's pointer names a folder on the shared volume: checked there
            overrides = started.output
            trained = train_step(s, resolved, data, overrides)
            export_and_evaluate(s, trained.outputs["model"], data, overrides, export_dtype=export_dtype, copy_model=copy_model,
                                export_uri=export_uri)

    return alignment
