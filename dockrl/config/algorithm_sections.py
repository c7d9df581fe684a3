"""The run configuration's algorithm sections: ``algorithm`` (with DAPO's ``filter_groups`` and
``overlong_buffer``), ``reward_model`` and ``teacher``; frozen, keyword-only dataclasses, one docstring per field.

Their rules (ranges and runnable combinations of ``algorithm``, DAPO's settings and ``reward_model``) are beside them,
below; ``Config`` (``dockrl.config.config``) holds one of each.
"""

from __future__ import annotations

import dataclasses
import math
import string
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from dockrl.config.errors import IMPORT_PATH, fail, require_finite
from dockrl.config.estimators import ESTIMATORS, AdvEstimator, estimator_names
from dockrl.config.run_sections import DockConfig
from dockrl.config.sections import CriticConfig, RolloutConfig


@dataclass(frozen=True, kw_only=True)
class FilterGroupsConfig:
    """DAPO's dynamic sampling (arXiv 2503.14476 §3.2; verl's ``algorithm.filter_groups``): train
    only on groups whose responses are not all equal in ``metric``, sampling further rounds of
    prompts until ``trainer.global_batch`` such groups are found (docs/algorithms.md)."""

    enable: bool = False
    """Filter the groups and refill from the next prompts; the trained batch stays exactly
    ``trainer.global_batch`` groups."""
    metric: Literal["acc", "score"] = "acc"
    """What must differ within a kept group: ``acc``, the ``correct`` column (DAPO's choice);
    ``score``, the reward ``rm_score`` (after the overlong shaping)."""
    max_num_gen_batches: int = 3
    """Rollout rounds per iteration, the first included, each of ``trainer.global_batch`` prompts
    (verl's name). At least 1: verl's 0 (no limit) is refused, so an iteration always ends."""
    on_exhausted: Literal["error", "fill"] = "error"
    """When the rounds are used up with fewer kept groups than ``trainer.global_batch``:
    ``error`` fails the run naming these fields (verl's behaviour); ``fill`` trains on what it
    has, the kept groups topped up with the first filtered ones to the configured size (they
    carry no group-relative signal)."""

    @property
    def rounds(self) -> int:
        """Rollout rounds an iteration holds rows for: ``max_num_gen_batches`` when enabled, else 1."""
        return self.max_num_gen_batches if self.enable else 1


@dataclass(frozen=True, kw_only=True)
class OverlongBufferConfig:
    """DAPO's soft overlong punishment (arXiv 2503.14476 §3.4, eq. 13; verl's
    ``reward_model.overlong_buffer``): the reward of a response in the last ``len`` tokens before
    ``rollout.max_response_length`` drops linearly, by up to ``penalty_factor``
    (``dockrl.algorithms.dapo.overlong_penalty``)."""

    enable: bool = False
    """Add the length penalty to every reward."""
    len: int = 16
    """L_cache: the buffer, in tokens before ``rollout.max_response_length``, where the penalty grows."""
    penalty_factor: float = 1.0
    """The penalty at ``rollout.max_response_length`` (eq. 13's 1)."""


@dataclass(frozen=True, kw_only=True)
class AlgorithmConfig:
    """The RL algorithm: advantage estimator, policy loss, KL terms and the reward. Names follow
    verl's where it has the concept (docs/algorithms.md maps each verl name to its field here)."""

    adv_estimator: Annotated[AdvEstimator, ESTIMATORS] = "grpo"
    """Advantage estimator (``dockrl.algorithms.compute_advantages``): group-normalized (GRPO),
    leave-one-out (RLOO), batch-whitened discounted returns (REINFORCE++), GAE with a critic (PPO),
    or group-centered without the std (Dr. GRPO)."""
    norm_adv_by_std_in_grpo: bool = True
    """``grpo`` divides the group-centered rewards by the group std; false: only centered (as ``dr_grpo``)."""
    adv_eps: float = 1e-6
    """ε added to the std in the advantage denominator (``grpo``) and to the variance when whitening."""
    gamma: float = 1.0
    """Discount γ of the token-level returns (``gae``, ``reinforce_plus_plus``)."""
    lam: float = 1.0
    """λ of GAE (``gae``)."""
    loss_agg_mode: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"] = "token-mean"
    """How per-token losses become the mini-batch loss: mean over all tokens; mean over sequences of
    each sequence's token mean; of its token sum; or the token sum over the constant
    ``rollout.max_response_length`` (Dr. GRPO) (``dockrl.algorithms.aggregate_loss``)."""
    ratio_level: Literal["token", "sequence"] = "token"
    """Importance ratio of the clipped loss: per token (PPO/GRPO) or the length-normalized
    sequence ratio (GSPO; with ``loss_agg_mode=seq-mean-token-mean``, its eq. 5)."""
    clip_ratio_low: float = 0.2
    """Lower clip ε of the ratio (1 - ε)."""
    clip_ratio_high: float = 0.28
    """Upper clip ε of the ratio (1 + ε); DAPO's clip-higher."""
    clip_ratio_c: float = 0.0
    """Dual-clip bound c > 1 of the loss of a negative-advantage token (``-c·A`` at most); 0: off
    (0 < c <= 1 is refused: the bound would cut below the clipped loss)."""
    entropy_coeff: float = 0.0
    """Coefficient of the entropy bonus subtracted from the loss; 0: off."""
    tis_cap: float = 0.0
    """Truncated importance sampling: the policy loss of each token is weighted by
    ``min(π_old/π_rollout, tis_cap)`` (rollout engine's log-probs); 0: off, else at least 1 (a cap
    below 1 would scale every token's loss down)."""
    rollout_correction: Literal["none", "mis_token", "mis_sequence", "icepop"] = "none"
    """Masked correction of the rollout–trainer mismatch, beside TIS
    (``dockrl.algorithms.rollout_correction``): with ``ρ = π_old/π_rollout`` (rollout engine's
    log-probs), ``mis_token`` masks tokens with ``ρ > rollout_ratio_high`` out of the policy loss,
    ``mis_sequence`` whole sequences whose ratio ``Π_t ρ_t`` exceeds it, ``icepop`` tokens with ``ρ``
    outside ``[rollout_ratio_low, rollout_ratio_high]``; kept tokens are weighted by their ratio.
    ``none``: off. Not with ``tis_cap`` (each weights the loss by the ratio)."""
    rollout_ratio_high: float = 2.0
    """Upper bound C of the ratio ``π_old/π_rollout`` kept by ``rollout_correction`` (IcePop's β;
    it uses 5.0); also the cap of ``actor/rollout_frac_beyond_cap`` when ``tis_cap`` is 0. At least 1."""
    rollout_ratio_low: float = 0.5
    """Lower bound α of the ratio kept by ``rollout_correction='icepop'`` (its value 0.5), in (0, 1]."""
    kl_loss_coef: float = 0.0
    """β of the KL penalty to the reference in the loss; 0: none (without ``kl_in_reward_coef`` no
    reference stage runs)."""
    kl_loss_type: Literal["low_var_kl", "kl", "abs", "mse"] = "low_var_kl"
    """KL estimator of the loss penalty: k3 (``low_var_kl``), k1 (``kl``), |k1| (``abs``), k2 (``mse``)."""
    kl_in_reward_coef: float = 0.0
    """β of the per-token KL penalty subtracted from the token rewards (``gae``,
    ``reinforce_plus_plus``); 0: none."""
    kl_penalty: Literal["kl", "abs", "mse", "low_var_kl"] = "kl"
    """KL estimator of the in-reward penalty (as ``kl_loss_type``)."""
    correct_reward: float = 1.0
    """Reward for a correct final answer."""
    format_reward: float = 0.1
    """Reward for a well-formed '#### <number>' final answer."""
    reward_timeout_s: float = 5.0
    """Per-sample verifier timeout; a timeout scores 0 and is counted."""
    scorer: str = ""
    """Custom reward scorer as ``module:Class`` (built with ``timeout_s``, ``correct_reward``,
    ``format_reward``; methods ``score``, ``counters``, ``close`` as ``RewardScorer``), run in a
    process of its own under ``reward_timeout_s`` per sample; empty: the strict GSM8K rule verifier."""
    max_bad_reward_frac: float = 0.25
    """Largest fraction of an iteration's rewards that may be bad — not a finite number, missing,
    timed out or failed (each scores 0) — before the run fails naming the scorer."""
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    """DAPO's dynamic sampling (``algorithm.filter_groups.*``)."""
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)
    """DAPO's overlong reward shaping (``algorithm.overlong_buffer.*``)."""
    overlong_filter: bool = False
    """DAPO's overlong filtering (§3.4): truncated responses (the ``truncated`` column) are masked
    out of the policy loss and its normalizer."""

    @property
    def uses_reference(self) -> bool:
        """Whether the run needs the reference's log-probs (a KL term in the loss or in the reward)."""
        return self.kl_loss_coef > 0 or self.kl_in_reward_coef > 0

    @property
    def corrects_rollout(self) -> bool:
        """Whether the policy loss reads the rollout engine's log-probs (TIS or a masked correction)."""
        return self.tis_cap > 0 or self.rollout_correction != "none"


@dataclass(frozen=True, kw_only=True)
class RewardModelPathConfig:
    path: str = ""
    """Local HF folder of a reward model with one label: a sequence classifier
    (``AutoModelForSequenceClassification``, e.g. ``Qwen2ForSequenceClassification``) or a value head
    per token (``…ForTokenClassification``, as verl's), read at the last token; with ``reward_model.kind=generative``
    a causal LM, the judge. Frozen, never trained."""
    trust_remote_code: bool = False
    """Passed to ``from_pretrained``; keep off unless the model directory is yours."""


JUDGE_FIELDS = ("prompt", "response", "ground_truth")
"""The placeholders of ``reward_model.generative.template``."""
JUDGE_PARSERS = ("number", "label")
"""The built-in verdict parsers (``dockrl.rewards.verdicts.PARSERS``); else a user's ``module:function``."""


@dataclass(frozen=True, kw_only=True)
class GenerativeJudgeConfig:
    """A generative reward model (LLM-as-judge, ``reward_model.kind=generative``): the model writes a verdict on
    each response from ``template``, and ``parser`` turns the verdict into ``rm_model_score``
    (``dockrl.engines.judge.GenerativeJudge``)."""

    template: str = ""
    """The judge's prompt, with ``{response}`` and optionally ``{prompt}`` and ``{ground_truth}`` (Python
    ``str.format`` fields; ``{{``/``}}`` for braces): the response and prompt as text (special tokens skipped), the
    row's reference answer. Sent as a user turn of the judge's chat template (``chat``)."""
    parser: str = "number"
    """``number``: the verdict's first number; ``label``: the score of the first of ``labels`` in it; or
    ``module:function`` taking the verdict text and returning a float, or None when it cannot tell."""
    labels: tuple[str, ...] = ()
    """``label=score`` pairs of the ``label`` parser (``correct=1,incorrect=0``), matched as whole words, any case."""
    unparsed_score: float = 0.0
    """The score of a verdict the parser cannot read (counted: ``reward_model/unparsed_frac``)."""
    max_new_tokens: int = 16
    """Longest verdict in tokens (a verdict cut there is parsed as it is)."""
    timeout_s: float = 300.0
    """Longest the judge may take over one claim of rows (``micro_batch_size × 4``); more fails the run, naming this field."""
    engine: Literal["hf", "vllm"] = "hf"
    """The judge's generation engine, greedy: transformers (``HFRolloutEngine``) or vLLM (``VLLMRolloutEngine``, a process of its
    own: ``dock.mode=distributed``, or beside an HF rollout)."""
    chat: bool = True
    """Wrap the rendered template as a user turn of the judge's chat template (with the generation prompt); false: as is."""


@dataclass(frozen=True, kw_only=True)
class RewardModelConfig:
    """verl's ``reward_model:`` section: a learned scorer next to the rule verifier. Its stage
    (``dockrl/stages/reward_model.py``) writes ``rm_model_score``; the reward stage writes
    ``rm_score = rule_weight · rule + model_weight · model``."""

    enable: bool = False
    """Run the reward-model stage and add its score to the rule reward."""
    kind: Literal["classifier", "generative"] = "classifier"
    """``classifier``: a one-label sequence classifier or value head scores each response; ``generative``: a causal
    LM writes a verdict that ``reward_model.generative`` parses (LLM-as-judge)."""
    generative: GenerativeJudgeConfig = field(default_factory=GenerativeJudgeConfig)
    """The judge's template, parser and bounds (``reward_model.kind=generative``)."""
    model: RewardModelPathConfig = field(default_factory=RewardModelPathConfig)
    """The reward model (``reward_model.model.path``)."""
    micro_batch_size: int = 8
    """Sequences per forward pass of the reward model (verl: ``micro_batch_size_per_gpu``)."""
    model_weight: float = 1.0
    """Weight of the reward model's score in ``rm_score``."""
    rule_weight: float = 1.0
    """Weight of the rule verifier's reward in ``rm_score`` (0: the reward model alone; the
    verifier still decides ``correct`` and ``reward/accuracy``)."""


@dataclass(frozen=True, kw_only=True)
class TeacherPathConfig:
    path: str = ""
    """Local HF folder of the teacher, a causal LM with the student's tokenizer (``model.path``'s); frozen, never trained."""
    trust_remote_code: bool = False
    """Passed to ``from_pretrained``; keep off unless the model directory is yours."""


@dataclass(frozen=True, kw_only=True)
class TeacherConfig:
    """On-policy distillation (GKD, Agarwal et al., 2024, arXiv 2306.13649; Thinking Machines, "On-Policy
    Distillation", 2025): the student samples, a frozen teacher scores every sampled token (its stage,
    ``dockrl/stages/teacher.py``, writes ``teacher_log_prob``) and each token's advantage becomes
    ``reward_weight · A_t + coef · (log p_teacher(y_t) - log p_student(y_t))``
    (``dockrl.algorithms.distillation.distillation_advantages``)."""

    enable: bool = False
    """Run the teacher stage and add the per-token reverse-KL advantage to the task's."""
    model: TeacherPathConfig = field(default_factory=TeacherPathConfig)
    """The teacher (``teacher.model.path``)."""
    coef: float = 1.0
    """λ: weight of the per-token reverse-KL advantage ``log p_teacher - log p_student`` (nats)."""
    reward_weight: float = 1.0
    """Weight of the task reward's advantages (``algorithm.adv_estimator``'s); 0: distillation alone."""


def check_teacher(t: TeacherConfig, a: AlgorithmConfig) -> None:
    """The teacher's ranges, and what it runs with."""
    if not t.enable:
        _refuse_settings_when_off("teacher", t, type(t)())
        return
    if not t.model.path.strip():
        raise fail("teacher.model.path", t.model.path, "teacher.enable=true needs the folder of the teacher, a causal LM "
                   "with the student's tokenizer (or teacher.enable=false)")
    require_finite({"teacher.coef": t.coef}, zero=False)
    require_finite({"teacher.reward_weight": t.reward_weight}, zero=True)
    if a.filter_groups.enable:
        raise fail("teacher.enable", t.enable, "not supported with algorithm.filter_groups.enable=true (dynamic sampling "
                   "keeps groups by the task reward before the teacher's scores are in): set one of them false")


def _refuse_settings_when_off(where: str, section: Any, unset: Any, switch: str = "") -> None:
    """A section whose ``enable`` (``switch``, default ``where.enable``) is false ignores its other
    fields: any of them set (not its default, nested sections included) is refused naming it, as
    the critic's settings are."""
    switch = switch or f"{where}.enable"
    for f in dataclasses.fields(section):
        value, default = getattr(section, f.name), getattr(unset, f.name)
        if dataclasses.is_dataclass(value):
            _refuse_settings_when_off(f"{where}.{f.name}", value, default, switch)
        elif f.name != "enable" and value != default:
            raise fail(f"{where}.{f.name}", value, f"is set but {switch} is false: enable it or leave the field unset")


def check_reward_model(m: RewardModelConfig) -> None:
    if not m.enable:
        _refuse_settings_when_off("reward_model", m, type(m)())
        return
    if not m.model.path.strip():
        raise fail("reward_model.model.path", m.model.path, "reward_model.enable=true needs the folder of a "
                    "sequence-classification reward model, or with reward_model.kind=generative of a causal LM judge "
                    "(or reward_model.enable=false)")
    if m.micro_batch_size < 1:
        raise fail("reward_model.micro_batch_size", m.micro_batch_size, "expected a positive integer")
    for where, x in (("reward_model.model_weight", m.model_weight), ("reward_model.rule_weight", m.rule_weight)):
        if not math.isfinite(x):
            raise fail(where, x, "expected a finite number")
    if m.model_weight == 0:
        raise fail("reward_model.model_weight", m.model_weight, "the reward model would run for nothing: "
                    "give it a weight, or set reward_model.enable=false")
    if m.kind == "generative":
        check_judge(m.generative)
    else:
        _refuse_settings_when_off("reward_model.generative", m.generative, GenerativeJudgeConfig(),
                                  switch="reward_model.kind=generative")


def check_judge(g: GenerativeJudgeConfig) -> None:
    """The generative judge's template, parser and bounds."""
    where = "reward_model.generative.template"
    try:
        names = {name for _, name, _, _ in string.Formatter().parse(g.template) if name is not None}
    except ValueError as e:
        raise fail(where, g.template, f"is no str.format template ({e}); write braces as {{{{ and }}}}") from None
    if "response" not in names:
        raise fail(where, g.template, "expected a prompt with a {response} field (and optionally {prompt}, {ground_truth})")
    if names - set(JUDGE_FIELDS):
        raise fail(where, g.template, f"unknown field(s) {sorted(names - set(JUDGE_FIELDS))}; expected "
                   f"{', '.join('{' + f + '}' for f in JUDGE_FIELDS)} (braces of the text itself as {{{{ and }}}})")
    if g.parser not in JUDGE_PARSERS and not IMPORT_PATH.match(g.parser):
        raise fail("reward_model.generative.parser", g.parser, f"expected {' or '.join(map(repr, JUDGE_PARSERS))}, "
                   "or a function as 'package.module:function'")
    if (g.parser == "label") != bool(g.labels):
        raise fail("reward_model.generative.labels", list(g.labels), "the label parser needs label=score pairs (e.g. "
                   "correct=1,incorrect=0), and only it reads them" if g.parser == "label" else
                   f"only read by reward_model.generative.parser='label' (got {g.parser!r}): leave it empty")
    for pair in g.labels:
        label, _, score = pair.rpartition("=")
        try:
            ok = bool(label.strip()) and math.isfinite(float(score))
        except ValueError:
            ok = False
        if not ok:
            raise fail("reward_model.generative.labels", list(g.labels), f"{pair!r} is not label=score with a finite score")
    require_finite({"reward_model.generative.timeout_s": g.timeout_s}, zero=False)
    if not math.isfinite(g.unparsed_score):
        raise fail("reward_model.generative.unparsed_score", g.unparsed_score, "expected a finite number")
    if g.max_new_tokens < 1:
        raise fail("reward_model.generative.max_new_tokens", g.max_new_tokens, "expected a positive integer")


def check_algorithm(a: AlgorithmConfig, critic: CriticConfig) -> None:
    """The algorithm's ranges and the combinations it can run; each error names the fields and the fix."""
    require_finite({"algorithm.reward_timeout_s": a.reward_timeout_s}, zero=False)
    require_finite({"algorithm.kl_loss_coef": a.kl_loss_coef, "algorithm.kl_in_reward_coef": a.kl_in_reward_coef,
                    "algorithm.adv_eps": a.adv_eps, "algorithm.clip_ratio_high": a.clip_ratio_high,
                    "algorithm.entropy_coeff": a.entropy_coeff, "algorithm.correct_reward": a.correct_reward,
                    "algorithm.format_reward": a.format_reward}, zero=True)
    if not a.correct_reward > a.format_reward:
        raise fail("algorithm.correct_reward", a.correct_reward, f"must exceed algorithm.format_reward={a.format_reward}")
    if not (0 <= a.max_bad_reward_frac <= 1):
        raise fail("algorithm.max_bad_reward_frac", a.max_bad_reward_frac, "expected a fraction from 0 to 1")
    if a.scorer and not IMPORT_PATH.match(a.scorer):
        raise fail("algorithm.scorer", a.scorer, "expected an import path 'package.module:Class', or '' for the built-in verifier")
    if not (0 <= a.clip_ratio_low < 1):
        raise fail("algorithm.clip_ratio_low", a.clip_ratio_low, "expected 0 <= clip_ratio_low < 1")
    if not (a.clip_ratio_c == 0 or 1 < a.clip_ratio_c < math.inf):
        raise fail("algorithm.clip_ratio_c", a.clip_ratio_c, "expected 0 (no dual-clip) or a finite bound > 1 (verl: 3.0)")
    if not (a.tis_cap == 0 or 1 <= a.tis_cap < math.inf):  # a cap below 1 would scale every token's loss down
        raise fail("algorithm.tis_cap", a.tis_cap, "expected 0 (no truncated importance sampling) or a finite cap >= 1 (verl: 2.0)")
    _check_rollout_correction(a)
    if a.ratio_level == "sequence" and a.loss_agg_mode != "seq-mean-token-mean":
        raise fail("algorithm.loss_agg_mode", a.loss_agg_mode, "algorithm.ratio_level='sequence' (GSPO) averages each "
                    "sequence's token losses, then the sequences (arXiv 2507.18071, eq. 5): set "
                    "algorithm.loss_agg_mode='seq-mean-token-mean', or algorithm.ratio_level='token'")
    for where, x in {"algorithm.gamma": a.gamma, "algorithm.lam": a.lam}.items():
        if not (0 <= x <= 1):
            raise fail(where, x, "expected a number from 0 to 1")
    estimator = ESTIMATORS[a.adv_estimator]
    if estimator.needs_values and not critic.enable:  # PPO's values come from the critic stage
        what = "GAE" if a.adv_estimator == "gae" else f"algorithm.adv_estimator={a.adv_estimator!r}"
        raise fail("algorithm.adv_estimator", a.adv_estimator, f"{what} needs the critic's values: set critic.enable=true, "
                   f"or use {estimator_names(needs_values=False)}")
    if a.adv_estimator == "dr_grpo" and a.loss_agg_mode != "seq-mean-token-sum-norm":
        raise fail("algorithm.loss_agg_mode", a.loss_agg_mode, "algorithm.adv_estimator='dr_grpo' pairs its unnormalized "
                    "advantages with the constant normalizer: set algorithm.loss_agg_mode='seq-mean-token-sum-norm' (or use "
                    "adv_estimator='grpo' with norm_adv_by_std_in_grpo=false for the advantages alone)")
    if not a.norm_adv_by_std_in_grpo and a.adv_estimator != "grpo":
        raise fail("algorithm.norm_adv_by_std_in_grpo", a.norm_adv_by_std_in_grpo,
                    f"applies to adv_estimator='grpo' only (got algorithm.adv_estimator={a.adv_estimator!r}): remove it")
    if a.kl_in_reward_coef > 0 and not estimator.token_rewards:
        raise fail("algorithm.kl_in_reward_coef", a.kl_in_reward_coef, f"algorithm.adv_estimator={a.adv_estimator!r} scores "
                    "whole responses and has no per-token rewards to subtract a KL penalty from: use algorithm.kl_loss_coef "
                   f"(KL in the loss, as GRPO), or adv_estimator {estimator_names(token_rewards=True)}")


def _check_rollout_correction(a: AlgorithmConfig) -> None:
    """The masked corrections' bounds (``algorithm.rollout_correction``) and their refusal beside TIS."""
    if not (1 <= a.rollout_ratio_high < math.inf):  # a bound below 1 would mask on-policy tokens, whose ratio is 1
        raise fail("algorithm.rollout_ratio_high", a.rollout_ratio_high, "expected a finite bound >= 1 (the ratio of an "
                    "on-policy token is 1; MIS: 2.0, IcePop: 5.0)")
    if not (0 < a.rollout_ratio_low <= 1):
        raise fail("algorithm.rollout_ratio_low", a.rollout_ratio_low, "expected a bound in (0, 1] (IcePop: 0.5)")
    if a.rollout_correction != "icepop" and a.rollout_ratio_low != AlgorithmConfig().rollout_ratio_low:
        raise fail("algorithm.rollout_ratio_low", a.rollout_ratio_low, "is set but only algorithm.rollout_correction='icepop' "
                    f"reads it (got algorithm.rollout_correction={a.rollout_correction!r}): use 'icepop' or remove the field")
    if a.rollout_correction != "none" and a.tis_cap > 0:
        raise fail("algorithm.rollout_correction", a.rollout_correction, f"and algorithm.tis_cap={a.tis_cap} both weight each "
                    "token's loss by its ratio π_old/π_rollout: choose one (algorithm.tis_cap=0, or algorithm.rollout_correction='none')")


def check_dapo(a: AlgorithmConfig, r: RolloutConfig, dock: DockConfig, critic: CriticConfig) -> None:
    """DAPO's dynamic sampling and overlong shaping: their ranges and what they combine with."""
    f, o = a.filter_groups, a.overlong_buffer
    if f.max_num_gen_batches < 1:
        raise fail("algorithm.filter_groups.max_num_gen_batches", f.max_num_gen_batches,
                    "expected a positive integer: the rollout rounds of an iteration need a bound (verl's 0, no limit, "
                    "could sample forever on data the model always or never solves)")
    if o.enable and not 1 <= o.len <= r.max_response_length:
        raise fail("algorithm.overlong_buffer.len", o.len, f"expected 1 to rollout.max_response_length={r.max_response_length}: "
                    "the buffer lies before the maximum length")
    if not (0 <= o.penalty_factor < math.inf):
        raise fail("algorithm.overlong_buffer.penalty_factor", o.penalty_factor, "expected a finite number >= 0")
    if not o.enable:
        _refuse_settings_when_off("algorithm.overlong_buffer", o, type(o)())
    if not f.enable:
        _refuse_settings_when_off("algorithm.filter_groups", f, type(f)())
        return
    if dock.mode == "distributed" and dock.placement == "beside":
        raise fail("dock.placement", dock.placement, "algorithm.filter_groups.enable needs one dock shard (dock.placement=apart, "
                    "dock.shards=1); beside puts a shard beside every stage node (docs/algorithms.md)")
    if dock.shards != 1:
        raise fail("dock.shards", dock.shards, "algorithm.filter_groups.enable needs dock.shards=1: a claim across "
                    "shards waits on one shard at a time, and the rows of a round released later may all lie on another, "
                    "which it would see only at its timeout (docs/algorithms.md)")
    if critic.enable:
        raise fail("critic.enable", critic.enable, "algorithm.filter_groups.enable: the critic's values feed the "
                    "advantages, so it would score every sampled group before dynamic sampling chose the trained ones; "
                    "DAPO trains without a critic: turn one of them off")
    if a.kl_in_reward_coef > 0:
        raise fail("algorithm.kl_in_reward_coef", a.kl_in_reward_coef, "algorithm.filter_groups.enable: the reference scores only "
                    "the groups dynamic sampling keeps, after the advantage stage chose them, so the advantages cannot "
                    "wait for its log-probs; use algorithm.kl_loss_coef (KL in the loss) or turn one of them off")
