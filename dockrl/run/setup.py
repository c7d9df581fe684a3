"""Run set-up, shared by the driver and every stage process: the model and data a run uses, its
prompts and the order they are drawn in, seeding, and the ``RunPlan`` the driver starts from.

Everything here sits below the driver (``dockrl/driver.py``) and the stage workers
(``dockrl/stages/``): it imports neither.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence, TypeVar

import torch
from safetensors import safe_open

from dockrl.checkpoint.resume_point import RUN_MARKERS, ResumePoint, check_resume_prompts, find_resume, prompts_fingerprint
from dockrl.config import Config, ConfigError, TrainerConfig, resolve_auto, save_config
from dockrl.envs.prompting import tool_prompt
from dockrl.run.data import Prompt, check_chat_template, check_data_file, export_champ, generate_problems, load_prompts, write_jsonl
from dockrl.run.lock import LOCK_FILE
from dockrl.run.models import prepare_smollm2

logger = logging.getLogger(__name__)

PACKAGED_MODEL = "smollm2-135m"
T = TypeVar("T")


@dataclass(frozen=True, kw_only=True)
class RunPlan:
    """What the driver settled before any stage starts (``plan_run``)."""

    cfg: Config
    """The run's config; with a resume, ``run.resume`` names the checkpoint folder itself (never
    ``latest``: a newer checkpoint may appear while the stages start)."""
    model_path: Path
    """The model folder (``resolve_model``); the stages start from ``resume.weights_path``."""
    train_prompts: list[Prompt]
    test_prompts: list[Prompt]
    fingerprint: str
    """``prompts_fingerprint`` of the training prompts: a checkpoint is only resumed with the same."""
    resume: ResumePoint | None
    """The checkpoint this run continues from; None for a fresh run."""


def plan_run(cfg: Config) -> RunPlan:
    """Resolve the config's ``auto`` fields for this machine (``resolve_auto``); seed; check what
    ``run.resume`` and the run folder allow and that the given data files are of a kind
    ``load_prompts`` reads (seconds: before anything slow); resolve the model and data, load the
    prompts, check them against the checkpoint's, and only then write
    ``RUN/config.yaml`` (a refused run leaves the folder as it was) with ``run.resume`` as given;
    the plan's config names the checkpoint found (``latest`` resolved), which every stage resumes.

    Raises:
        ConfigError: ``model.path``, ``reward_model.model.path``, the data files or ``run.resume`` do not fit (named).
    """
    cfg = resolve_auto(cfg)  # the run's one resolution: config.yaml and every in-process stage get its answer
    if cfg.run.num_threads:
        torch.set_num_threads(cfg.run.num_threads)
    seed_everything(cfg.trainer.seed)
    point = find_resume(cfg, None)  # what run.resume and the folder allow, in a second, before model and data take their time
    check_data_paths(cfg)
    model_path = resolve_model(cfg)  # prepared here once, before any stage looks for it
    if cfg.reward_model.enable:
        resolve_reward_model(cfg)
    if cfg.teacher.enable:
        resolve_teacher(cfg, model_path)
    train_file, test_file = resolve_data(cfg)
    from dockrl.engines.hf.load import load_tokenizer  # transformers' models: seconds, after the model and data are known to be there
    from dockrl.envs.registry import environment_tools  # lazy: the rewards it imports need math_verify; the actor does not

    tools = environment_tools(cfg)  # the prompts show the environment's tools; a user's environment that fails to build fails here
    train_prompts, test_prompts = load_run_prompts(cfg, load_tokenizer(model_path, cfg.model.trust_remote_code), train_file, test_file,
                                                   tools=tools)
    fingerprint = prompts_fingerprint([p.prompt_ids for p in train_prompts])
    check_resume_prompts(point, fingerprint)
    if point is None:
        set_aside_stopped_run(Path(cfg.run.output_dir))
    # run.resume as given (`latest` stays `latest`): config.yaml run again continues the run, where the
    # checkpoint `latest` found now would rewind it to that iteration and cut the metrics after it
    save_config(recorded_paths(cfg), Path(cfg.run.output_dir) / "config.yaml")
    if point:  # the stages all continue from the one checkpoint found here
        cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, resume=str(point.checkpoint)))
    return RunPlan(cfg=cfg, model_path=model_path, train_prompts=train_prompts, test_prompts=test_prompts,
                   fingerprint=fingerprint, resume=point)


def recorded_paths(cfg: Config) -> Config:
    """``cfg`` as ``RUN/config.yaml`` records it: every local path absolute (resolved against this process's
    working folder), so that the run's files are found from any folder (``dockrl train --config RUN/config.yaml
    run.resume=latest``, ``dockrl rollouts``). What is not a local path stays as given: the packaged model, ``champ``,
    ``latest``, ``s3://`` URIs and empty fields."""
    def local(value: str, *names: str) -> str:
        return value if not value or value in names or "://" in value else str(Path(value).resolve())

    rm = cfg.reward_model
    return dataclasses.replace(
        cfg,
        model=dataclasses.replace(cfg.model, path=local(cfg.model.path, PACKAGED_MODEL)),
        data=dataclasses.replace(cfg.data, train_path=local(cfg.data.train_path), test_path=local(cfg.data.test_path, "champ")),
        reward_model=dataclasses.replace(rm, model=dataclasses.replace(rm.model, path=local(rm.model.path))),
        teacher=dataclasses.replace(cfg.teacher, model=dataclasses.replace(cfg.teacher.model, path=local(cfg.teacher.model.path))),
        critic=dataclasses.replace(cfg.critic, model_path=local(cfg.critic.model_path)),
        dock=dataclasses.replace(cfg.dock, directory=local(cfg.dock.directory)),
        run=dataclasses.replace(cfg.run, output_dir=local(cfg.run.output_dir), cache_dir=local(cfg.run.cache_dir),
                                resume=local(cfg.run.resume, "latest")),
    )


def set_aside_stopped_run(run_dir: Path) -> Path | None:
    """A fresh run in a folder whose run stopped before its first complete checkpoint (``find_resume`` lets it
    in: nothing there resumes, and the lock this run holds says no live process writes there) moves what that run
    left into ``RUN.stopped-<n>`` beside it (n = 1, 2, …), as a retried pipeline task does with a failed attempt
    (``dockrl.kubeflow.train_retry``): its logs, metrics and config kept, its incomplete checkpoints removed, and
    nothing of it mixes with this run's. Returns that folder; None when the run folder held no run."""
    if not any((run_dir / name).exists() for name in RUN_MARKERS):  # stopped before training: its config.yaml is rewritten
        return None
    n = 1 + sum(1 for p in run_dir.parent.glob(f"{run_dir.name}.stopped-*") if p.is_dir())
    aside = run_dir.with_name(f"{run_dir.name}.stopped-{n}")
    aside.mkdir()
    for entry in run_dir.iterdir():
        if entry.name != LOCK_FILE:  # held by this run
            entry.rename(aside / entry.name)
    shutil.rmtree(aside / "checkpoints", ignore_errors=True)
    logger.warning("run.output_dir: %s held a run that stopped before its first complete checkpoint; what it left (logs, metrics, "
                   "config) is set aside in %s and this run starts fresh", run_dir, aside)
    return aside


def check_data_paths(cfg: Config) -> None:
    """The configured data files (``data.train_path``, ``data.test_path``; not ``champ``, an ``s3://`` URI or
    empty: generated) exist and are of a kind ``load_prompts`` reads (``check_data_file``).

    Raises:
        ConfigError: naming the field and the file.
    """
    for field, path in (("data.train_path", cfg.data.train_path), ("data.test_path", cfg.data.test_path)):
        if path and path != "champ" and "://" not in path:
            as_config_error(field, check_data_file, path)


def resolve_model(cfg: Config) -> Path:
    """The model directory: the packaged SmolLM2 export (prepared once) or ``model.path``.

    Raises:
        ConfigError: ``model.path`` is not a local HF model folder (no ``config.json``):
            nothing is fetched from a hub.
    """
    if cfg.model.path == PACKAGED_MODEL:
        return prepare_smollm2(Path(cfg.run.cache_dir) / "models" / "SmolLM2-135M-Instruct")
    path = Path(cfg.model.path)
    if not (path / "config.json").is_file():
        raise ConfigError(f"model.path: got {cfg.model.path!r}; expected a local HF model folder with config.json "
                          f"(or {PACKAGED_MODEL!r} for the packaged SmolLM2-135M-Instruct)")
    check_model_dir(path, cfg.model.trust_remote_code)
    return path


def resolve_reward_model(cfg: Config) -> Path:
    """The reward model's folder (``reward_model.model.path``), checked as ``check_model_dir``
    does and as a one-label classifier or value head (``dockrl.engines.reward_model.check_reward_model_dir``);
    with ``reward_model.kind=generative`` a judge, any causal LM ``check_model_dir`` takes.

    Raises:
        ConfigError: naming ``reward_model.model.path``: not a local HF folder, unreadable
            weights, or (a classifier) not a sequence-classification model with one label.
    """
    from dockrl.engines.reward_model import check_reward_model_dir  # lazy: transformers' models, only with reward_model.enable

    m = cfg.reward_model.model
    path = Path(m.path)
    if not (path / "config.json").is_file():
        raise ConfigError(f"reward_model.model.path: got {m.path!r}; expected a local HF folder with config.json of a "
                          f"{'causal LM judge' if cfg.reward_model.kind == 'generative' else 'sequence-classification reward model'} "
                          "(nothing is fetched from a hub)")
    check_model_dir(path, m.trust_remote_code, field="reward_model.model.path")
    if cfg.reward_model.kind == "classifier":
        check_reward_model_dir(path)
    return path


def resolve_teacher(cfg: Config, student_path: Path) -> Path:
    """The teacher's folder (``teacher.model.path``), checked as ``check_model_dir`` does, with the
    student's tokenizer (``check_same_tokenizer``): distillation scores the student's token ids under the teacher.

    Raises:
        ConfigError: naming ``teacher.model.path``: not a local HF folder, unreadable weights, or a
            tokenizer other than the student's at ``student_path`` (both named).
    """
    from dockrl.engines.hf.load import load_tokenizer  # lazy: transformers' tokenizers, only with teacher.enable

    m = cfg.teacher.model
    path = Path(m.path)
    if not (path / "config.json").is_file():
        raise ConfigError(f"teacher.model.path: got {m.path!r}; expected a local HF folder with config.json of a causal LM "
                          "(nothing is fetched from a hub)")
    check_model_dir(path, m.trust_remote_code, field="teacher.model.path")
    check_same_tokenizer(load_tokenizer(student_path, cfg.model.trust_remote_code), load_tokenizer(path, m.trust_remote_code),
                         student_path, path)
    return path


def check_same_tokenizer(student: Any, teacher: Any, student_path: Path, teacher_path: Path, *, field: str = "teacher.model.path") -> None:
    """Refuse a teacher whose tokenizer differs from the student's: the same token → id map (special
    tokens included) and the same EOS. Cross-tokenizer distillation (ULD, GOLD) aligns text spans instead;
    dockrl does not.

    Raises:
        ConfigError: naming ``field`` (the teacher's) and ``model.path``, both folders and the first difference.
    """
    s_vocab, t_vocab = student.get_vocab(), teacher.get_vocab()
    diff = ""
    if s_vocab != t_vocab:
        token = next((tok for tok in sorted(s_vocab.keys() | t_vocab.keys()) if s_vocab.get(tok) != t_vocab.get(tok)), "")
        diff = (f"{len(t_vocab)} tokens against the student's {len(s_vocab)}; token {token!r} is id "
                f"{t_vocab.get(token)} in the teacher's, {s_vocab.get(token)} in the student's")
    elif student.eos_token_id != teacher.eos_token_id:
        diff = f"EOS id {teacher.eos_token_id} against the student's {student.eos_token_id}"
    if diff:
        raise ConfigError(f"{field}: the teacher's tokenizer ({teacher_path}) is not the student's "
                          f"(model.path: {student_path}): {diff}. On-policy distillation scores the student's token ids "
                          "under the teacher, so both must share one tokenizer: pick a teacher of the student's family")


def check_model_dir(path: Path, trust_remote_code: bool = False, *, field: str = "model.path") -> None:
    """Check an HF model folder before any engine loads it: a readable ``config.json`` of an
    architecture this transformers knows, weights, and safetensors files whose header and size
    agree (a truncated download fails here, naming the file).

    Raises:
        ConfigError: naming ``model.path``, the file and what is wrong with it.
    """
    try:
        doc = json.loads((path / "config.json").read_text())
        model_type = doc.get("model_type") if isinstance(doc, dict) else None
    except (OSError, ValueError) as e:
        raise ConfigError(f"{field}: {path / 'config.json'} is not readable JSON ({e})") from None
    if not trust_remote_code:
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING  # lazy: transformers takes seconds; a bad config fails first

        if model_type not in CONFIG_MAPPING:
            raise ConfigError(f"{field}: {path / 'config.json'} has model_type={model_type!r}, an architecture this "
                              "transformers does not know; use a Llama/Qwen2-architecture model (or "
                              f"{field.rsplit('.', 1)[0]}.trust_remote_code=true for a folder that ships its own code)")
    shards = sorted(path.glob("*.safetensors"))
    if not shards and not any(path.glob("*.bin")) and not any(path.glob("*.pt")):
        raise ConfigError(f"{field}: {path} has config.json but no weights (*.safetensors or *.bin); "
                          "copy the whole model folder (save_pretrained writes both)")
    for shard in shards:
        try:
            with safe_open(str(shard), framework="pt") as f:
                f.keys()
        except Exception as e:  # noqa: BLE001 - safetensors raises its own SafetensorError
            raise ConfigError(f"{field}: {shard} is not a readable safetensors file ({e}); "
                              "it may be truncated: copy or download it again") from None


def resolve_data(cfg: Config) -> tuple[Path, Path]:
    """Train and test files: the configured ones, or seeded generated problems (held-out test).

    Raises:
        ConfigError: a configured file does not exist, is not readable or not a data file (``check_data_paths``).
    """
    check_data_paths(cfg)
    d = cfg.data
    key = f"arith-s{cfg.trainer.seed}-steps{d.min_steps}-{d.max_steps}-max{d.max_number}"
    folder = Path(cfg.run.cache_dir) / "data" / key
    train, test = Path(d.train_path) if d.train_path else None, Path(d.test_path) if d.test_path else None
    gen = dict(min_steps=d.min_steps, max_steps=d.max_steps, max_number=d.max_number)
    if d.test_path == "champ":
        test = Path(cfg.run.cache_dir) / "data" / "champ.jsonl"
        if not test.is_file():
            export_champ(test)
    if test is None:
        test = folder / f"test-{d.generate_test}.jsonl"
        if not test.is_file():
            write_jsonl(generate_problems(d.generate_test, seed=1_000_003 + cfg.trainer.seed, **gen), test)
    if train is None:
        train = folder / f"train-{d.generate_train}.jsonl"
        if not train.is_file():
            held_out = {row["question"] for row in generate_problems(d.generate_test, seed=1_000_003 + cfg.trainer.seed, **gen)}
            rows = [r for r in generate_problems(d.generate_train, seed=cfg.trainer.seed, **gen) if r["question"] not in held_out]
            write_jsonl(rows, train)
    return train, test


def seed_everything(seed: int) -> None:
    """Seed Python's and torch's global generators (every process, once at its start)."""
    random.seed(seed)
    torch.manual_seed(seed)


def as_config_error(field: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)`` on a user's data file, its errors as ``ConfigError`` naming the setting ``field``."""
    try:
        return fn(*args, **kwargs)
    except (FileNotFoundError, ValueError) as e:
        raise ConfigError(f"{field}: {e}") from None


def load_run_prompts(cfg: Config, tokenizer, train_file: Path, test_file: Path, *,
                     tools: Sequence[dict] = ()) -> tuple[list[Prompt], list[Prompt]]:
    """Training prompts and the evaluation prompts (the first ``data.eval_size`` of the test file).

    ``tools``: the run's environment's tools (``environment_tools``; empty without one: every caller in a
    run with an environment passes them, or its prompts would differ from the driver's), shown to the
    model by the chat template or in the system prompt (``dockrl.envs.prompting.tool_prompt``).
    """
    check_chat_template(tokenizer, cfg.data.chat_template, cfg.model.path)  # names model.path, not a data file
    shown = tool_prompt(tokenizer, tools, cfg.env.tool_parser, system_prompt=cfg.data.system_prompt,
                        chat_template=cfg.data.chat_template)
    load: dict[str, Any] = dict(system_prompt=shown.system_prompt, max_prompt_length=cfg.data.max_prompt_length,
                                chat_template=cfg.data.chat_template, model=cfg.model.path, tools=shown.tools)
    out = []
    for field, path in (("data.train_path", train_file), ("data.test_path", test_file)):
        prompts, report = as_config_error(field, load_prompts, path, tokenizer, **load)
        logger.info("data %s: %d prompts (%d lines dropped, %d repeat a question)", field, report.kept, len(report.bad),
                    report.duplicates)
        out.append(prompts)
    train_prompts, test_prompts = out
    if cfg.data.eval_size:
        test_prompts = test_prompts[: cfg.data.eval_size]
    return train_prompts, test_prompts


def prompt_batches(prompts: Sequence[T], t: TrainerConfig, *, rounds: int = 1) -> Iterator[list[T]]:
    """The ``rounds × trainer.global_batch`` prompts of each iteration, seeded by ``trainer.seed``.

    Epochs follow each other as fresh seeded permutations of all prompts, so every prompt is
    used once per epoch; a batch that crosses the end of an epoch continues into the next.
    Deterministic: a resumed run regenerates the same batches (its position is the iteration).
    ``rounds`` > 1 (dynamic sampling, ``algorithm.filter_groups``): prompts for every rollout
    round an iteration may sample; those of rounds it does not sample are skipped, not reused.
    """
    rng = random.Random(t.seed)
    epoch: list[int] = []
    pos = 0
    size = rounds * t.global_batch
    for _ in range(t.iterations):
        picked: list[int] = []
        while len(picked) < size:
            if pos == len(epoch):  # next epoch over the prompts
                epoch = list(range(len(prompts)))
                rng.shuffle(epoch)
                pos = 0
            take = min(size - len(picked), len(epoch) - pos)
            picked += epoch[pos:pos + take]
            pos += take
        yield [prompts[i] for i in picked]
