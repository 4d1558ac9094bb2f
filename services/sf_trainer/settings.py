"""The trainer's settings (``SF_TRAINER_*``).

The loss and the advantage estimator are plug-in choices that carry the plug-in's own
settings (``seamlessflow.plugin_settings``): ``[trainer.loss]`` / ``SF_TRAINER_LOSS__<KEY>``
and ``[trainer.advantage]`` / ``SF_TRAINER_ADVANTAGE__<KEY>``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, PrivateAttr, model_validator
from pydantic.fields import FieldInfo
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from seamlessflow.machine import PrecisionChoice, resolve_precision
from seamlessflow.plugin_settings import NESTED_DELIMITER, PluginChoice
from seamlessflow.plugins import ChosenFrom
from seamlessflow.runfile import (
    RunFileSettings,
    RunFileSource,
    shared,
)
from seamlessflow.tasks.schedule import schedule_sources

ENV_PREFIX = "SF_TRAINER_"

RETIRED_LOSS_SETTINGS: dict[str, tuple[str, str]] = {
    "is_cap": ("is_cap", "grpo_decoupled"),
    "clip_eps": ("clip_eps", "grpo, grpo_decoupled or dr_grpo"),
    "clip_eps_low": ("clip_eps_low", "dapo"),
    "clip_eps_high": ("clip_eps_high", "dapo"),
    "gspo_clip_eps_low": ("clip_eps_low", "gspo"),
    "gspo_clip_eps_high": ("clip_eps_high", "gspo"),
    "dr_grpo_tokens": ("constant_tokens", "dr_grpo"),
}
"""Loss hyperparameters that were flat trainer settings: old field -> (its key in the
loss's own settings, the losses that read the flat setting: a record of where it went,
not a list of the losses, which is the registry's). Set (``SF_TRAINER_IS_CAP``,
``[trainer] is_cap``), they stop a process with the new spelling instead of being
ignored."""


def retired_loss_setting(field: str) -> str:
    """The one line that refuses the flat loss setting ``field`` and names its new spelling."""
    key, losses = RETIRED_LOSS_SETTINGS[field]
    return (
        f"{ENV_PREFIX}{field.upper()} ([trainer] {field}) is no longer read: the loss "
        f"carries its settings, set {ENV_PREFIX}LOSS{NESTED_DELIMITER}{key.upper()} "
        f"(or {key} under [trainer.loss]) with the loss {losses}"
    )


class LossChoice(PluginChoice):
    """``SF_TRAINER_LOSS`` and its ``SF_TRAINER_LOSS__<KEY>`` settings."""

    name: str = "grpo_decoupled"


class AdvantageChoice(PluginChoice):
    """``SF_TRAINER_ADVANTAGE`` and its ``SF_TRAINER_ADVANTAGE__<KEY>`` settings."""

    name: str = "grpo"


PLUGIN_FIELDS = ("loss", "advantage")
"""The fields that are a :class:`PluginChoice`: a name, or a table of the plug-in's keys."""


def _as_choice(field_name: str, value: Any) -> Any:
    # a name alone becomes a table, so that another source's keys merge into it
    # (pydantic-settings merges the sources' tables; a string would replace them)
    return {"name": value} if field_name in PLUGIN_FIELDS and isinstance(value, str) else value


class PluginChoiceEnvSource(EnvSettingsSource):
    """The environment, where ``SF_TRAINER_LOSS=gspo`` names the loss (not JSON) and
    ``SF_TRAINER_LOSS__CLIP_EPS_LOW`` sets one of its keys; both together merge."""

    def prepare_field_value(
        self, field_name: str, field: FieldInfo, value: Any, value_is_complex: bool
    ) -> Any:
        if field_name in PLUGIN_FIELDS and isinstance(value, str) and not value.startswith("{"):
            keys = self.explode_env_vars(field_name, field, self.env_vars)
            return {"name": value, **keys}
        return super().prepare_field_value(field_name, field, value, value_is_complex)


class PluginChoiceRunFileSource(RunFileSource):
    """The run file, where ``[trainer] loss = "gspo"`` and a ``[trainer.loss]`` table are
    one choice (a retired flat loss key is refused by ``RunFileSource``)."""

    def __call__(self) -> dict[str, Any]:
        return {name: _as_choice(name, value) for name, value in super().__call__().items()}


class TrainerSettings(RunFileSettings):
    """trainer settings (env prefix ``SF_TRAINER_``)."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        env_nested_delimiter=NESTED_DELIMITER,
        extra="ignore",
        use_attribute_docstrings=True,
    )
    retired: ClassVar[Mapping[str, str]] = {
        field: retired_loss_setting(field) for field in RETIRED_LOSS_SETTINGS
    }
    _precision_choice: PrecisionChoice = PrivateAttr()

    steps: int = shared("steps")
    """Optimizer steps (one batch each); the trainer finishes after this many. Steps a
    resume lost (taken after the checkpoint it resumes from) count: their batches are
    not trained again. The policy's step budget: the trainer announces it at start
    (``TrainingPlanned``) and the trajectory service dispatches for it."""

    lr: float = shared("lr")
    """AdamW peak learning rate; ``lr_schedule`` and ``warmup_steps`` shape it over the
    run's ``steps``. The rate each step used is its metrics' ``lr``."""

    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """Learning rate after the warmup (``sf_trainer.schedule``): ``constant`` (``lr``),
    ``linear`` or ``cosine`` decay from ``lr`` to ``lr x min_lr_ratio``, reached at the
    end of the run (step ``steps``). A resume continues the schedule at its step."""

    warmup_steps: int = Field(default=0, ge=0)
    """Linear warmup: step s (0-based) of the first this many uses ``lr x (s + 1) /
    warmup_steps``; 0 = none."""

    min_lr_ratio: float = Field(default=0.0, ge=0.0, le=1.0)
    """``linear`` / ``cosine``: the rate the decay ends at, as a fraction of ``lr``."""

    precision: Literal["auto", "fp32", "bf16-mixed"] = shared("precision")
    """Compute precision of forward and backward. ``auto`` (resolved when the settings
    are read, ``seamlessflow.machine.resolve_precision``): ``bf16-mixed`` where ``device``
    computes bf16 natively (a CUDA device that supports it, a CPU whose oneDNN reports
    bf16), ``fp32`` elsewhere (an AVX2-only CPU computes bf16 ~40x slower than float32).
    ``fp32``: everything in float32.
    ``bf16-mixed``: master weights, gradients as the optimizer sees them and the AdamW
    state stay float32; forward and backward run in bfloat16 (one process: autocast;
    several ranks: FSDP2's ``MixedPrecisionPolicy`` with bf16 parameters, gradients
    reduced in float32). Logprobs are taken in float32 from the bf16 logits, so they
    differ from the engine's by bf16 rounding (``logprob_abs_diff`` shows it)."""

    master_dtype: Literal["float32", "bfloat16"] = "float32"
    """The dtype of the weights the optimizer updates (and of its AdamW state).
    ``float32``: the usual master weights, whatever ``precision`` computes in.
    ``bfloat16``: half the memory of weights, gradients and optimizer state (about 8
    bytes a parameter instead of 16), at the cost of updates smaller than bf16's
    resolution being lost. Forward and backward compute in bf16 in one process; on
    several ranks with ``precision`` fp32, FSDP2 gathers each unit's bf16 shards into
    float32 and computes in it (bf16 storage, float32 arithmetic: what a CPU without
    native bf16 runs at float32's pace)."""

    cpu_offload: bool = False
    """With several ranks on GPUs: parameters, gradients and the AdamW state stay in host
    memory between uses and the optimizer step runs on the CPU (FSDP2's
    ``CPUOffloadPolicy``); each unit's weights visit the GPU only for its forward and
    backward. It changes nothing (logged at start) for one process, which FSDP2 does
    not shard, or a CPU trainer, whose state is in host memory already."""

    gradient_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward pass instead of
    keeping them (HF gradient checkpointing, non-reentrant): less memory, about one more
    forward per step; the gradients are the same."""

    eval_every: int = shared("eval_every", ge=0)
    """Evaluate the policy on ``eval_task``'s held-out split every N steps, after the
    step's version is published (a ``TrainEvalMetrics`` record, also in
    ``metrics.jsonl``); 0 = never."""

    task: str = shared("task")
    """The run's task: evaluated unless ``eval_task`` names another."""

    eval_task: str = ""
    """Task source (``seamlessflow.tasks``) whose ``eval`` split is evaluated, built with
    the run's seed (``SF_SEED``: the split depends on it); empty: the run's ``task``
    (a policy of a multi-policy run may evaluate on its own). Several, comma-separated
    (``rg:chain_sum,rg:bf``), or a run's task schedule (every source it names): each is
    scored separately, by its own evaluation reward (``by_task`` in the record), and the
    record's mean is the mean of the tasks' means."""

    eval_items: int = Field(default=64, ge=0)
    """Prompts evaluated per task: the first N of its eval split (0 = all of it)."""

    eval_max_tokens: int = shared("max_tokens", ge=1)
    """Completion budget of each evaluated answer (greedy decoding)."""

    eval_batch_size: int = Field(default=64, ge=1)
    """Prompts generated together (left-padded) in an evaluation. One batch of 64 beats
    four of 16 by 1.45x on one AVX2 core (SmolLM2-135M, 64 prompts x 64 tokens greedy,
    float32: 52.7 s against 4 x 19.1 s): the matmuls are wider for the same steps."""

    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW betas (SRPO's choice)."""

    weight_decay: float = 0.0
    """AdamW weight decay."""

    fused_optimizer: bool = True
    """AdamW's fused kernel (``fused=True``): one pass over each parameter with its math in
    float32 (bf16 master weights included) and no temporary the size of the state. Off:
    torch's multi-tensor (``foreach``) AdamW, which computes in the parameters' dtype and
    allocates temporaries as large as the state. Measured on one core: 7x faster for 67M
    float32 parameters, updates equal to 2.4e-7."""

    max_grad_norm: float = 1.0
    """Gradient clipping by global norm."""

    advantage: Annotated[AdvantageChoice, ChosenFrom("sf_trainer.advantages:ESTIMATORS")] = (
        AdvantageChoice()
    )
    """Advantage estimator plug-in (``sf_trainer.advantages``): a registered name, or
    ``package.module:attribute``, an ``AdvantageEstimator``. Its own settings:
    ``SF_TRAINER_ADVANTAGE__<KEY>`` or ``[trainer.advantage]`` (with ``name``)."""

    loss: Annotated[LossChoice, ChosenFrom("sf_trainer.losses:LOSSES")] = LossChoice()
    """Policy loss plug-in (``sf_trainer.losses``): a registered name, or
    ``package.module:attribute``, a ``PolicyLoss``. Its own settings are
    ``SF_TRAINER_LOSS__<KEY>`` or keys of ``[trainer.loss]`` (with ``name``), and a key
    the chosen loss lacks is refused."""

    kl_coef: float = Field(default=0.0, ge=0.0)
    """Weight of the k3 KL to the reference model (the base model of ``SF_MODEL_DIR``,
    frozen), added to the loss per token. 0 = no KL term and no reference model loaded."""

    overlong_max_tokens: int = Field(default=0, ge=0)
    """DAPO soft overlong punishment, L_max: a response (its trained tokens) longer than
    this gets -1 added to its reward; 0 = off."""

    overlong_cache_tokens: int = Field(default=0, ge=0)
    """DAPO soft overlong punishment, L_cache: over the last this many tokens up to
    L_max the added reward falls linearly from 0 to -1 (reached at L_max)."""

    temperature: float = Field(default=1.0, ge=0.0)
    """Only for tokens recorded without their sampling temperature (a replay of streams
    recorded before turns carried it): their logprobs are recomputed at this one, so set
    it to what that run's agents used (0 = greedy). Every other token is recomputed at
    the temperature recorded with its turn; this setting does not apply to it."""

    micro_batch_tokens: int = Field(default=0, ge=0)
    """Gradient accumulation: each rank's sequences are packed into micro-batches of at
    most this many (padded) tokens: rows x the longest row. 0 (default): sized from the
    model and the memory found at start, so that one micro-batch's activations take
    about half of the memory free once the model is placed (``sf_trainer.memory``;
    256 to 16384 tokens; the trainer logs what it chose)."""

    trainers_on_host: int = Field(default=1, ge=1)
    """Trainers (of every policy) that start on this host and share its memory: on a
    CPU, the automatic micro-batch budget plans on this share of the available memory
    (each trainer reads "available" at its start, before the others have taken theirs).
    A multi-policy embedded run sets it to its number of policies; with a GPU per
    trainer, 1."""

    logprob_chunk_tokens: int = Field(default=1024, ge=0)
    """Tokens whose logits exist at once when the trainer takes logprobs (policy and
    reference): the final hidden states of the trained tokens go through the output
    embedding and the log-softmax this many tokens at a time, and with more than one
    chunk the backward recomputes each chunk's logits, so memory grows with chunk x
    vocabulary instead of micro-batch x vocabulary (``sf_trainer.logprobs``). 0 = whole
    logits. Models whose head is more than the output embedding (e.g. a final logit
    soft-cap) always use whole logits."""

    vocab_parallel: bool = True
    """With several ranks, split the input and output embeddings by vocabulary rows
    instead of letting FSDP2 gather them whole (``sf_trainer.vocab_parallel``): no rank
    holds a whole [vocab, hidden] matrix, its gradient or a whole chunk of logits. Needs
    chunked logprobs (``logprob_chunk_tokens`` > 0 and a plain head) and no
    ``cpu_offload`` of CUDA ranks (the split rows would stay on the device); otherwise,
    and with one process, it changes nothing. The gradients are the same sums."""

    checkpoint_every: int = shared("checkpoint_every")
    """Also checkpoint every N steps (0 = only at the end and on stop). A resume loses
    the steps after the checkpoint it starts from (the policy never learns from their
    batches)."""

    keep_checkpoints: int = Field(default=0, ge=0)
    """Keep only the newest N periodic checkpoints (``step-<n>``); 0 = keep them all.
    ``final`` is never removed."""

    resume: str = ""
    """Start from a checkpoint (model, optimizer, step, version, data position): empty =
    the base model; ``latest`` = the checkpoint with the most steps under
    ``<run_dir>/checkpoints``, or the base model if there is none; otherwise the path of
    a checkpoint directory."""

    claim_timeout_s: float = 30.0
    """Longest wait for the tag-scheduler to free the training slots (then train anyway)."""

    compact_heap: bool = True
    """Tune glibc's heap for tensors of megabytes before the model is built: a fixed mmap
    threshold (freed blocks go back to the kernel) and one arena
    (``seamlessflow.heap``). Measured on two CPU ranks of the Qwen2.5-0.5B shape: the
    peak resident memory per rank 1.2 GB lower (16-21%) and the first step 1.3-1.4x
    faster. Off: glibc's defaults (what ``MALLOC_*`` variables set still applies)."""

    offload_when_lent: Literal["auto", "on", "off"] = "auto"
    """While the tag-scheduler lends this trainer's slots to rollout, every rank moves its
    parameters and optimizer state to host memory (gradients are already freed after
    each step) and takes them back once its slots are claimed (``seamlessflow.residency``):
    what lets a lent engine use the accelerator's memory. ``auto``: on CUDA ranks; a CPU
    trainer's memory is host memory already, so ``on`` there only exercises the
    mechanism (the suite does). The scheduler lends only once the trainer has offloaded."""

    device: str = "cpu"
    """torch device of the policy (``cpu``, ``cuda``, ``cuda:1``). Under torchrun (several
    ranks) only the type counts: rank r uses ``cuda:<LOCAL_RANK>`` with nccl, or the CPU
    with gloo."""

    collective_timeout_s: float = 21600.0
    """Several ranks: the longest any collective may wait, including the other ranks'
    wait for rank 0's next command while it waits for a batch."""

    torch_threads: int = 1
    """torch intra-op threads."""

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # RunFileSettings' order, with the sources that read a plug-in choice
        return (
            init_settings,
            PluginChoiceEnvSource(settings_cls),
            dotenv_settings,
            PluginChoiceRunFileSource(settings_cls),
            file_secret_settings,
        )

    @model_validator(mode="after")
    def _plugins_take_their_keys(self) -> TrainerSettings:
        # the plug-ins' modules import torch: only when a choice is checked
        from sf_trainer.advantages import chosen_estimator
        from sf_trainer.losses import chosen_loss

        for variable, choose, choice in (
            (f"{ENV_PREFIX}LOSS", chosen_loss, self.loss),
            (f"{ENV_PREFIX}ADVANTAGE", chosen_estimator, self.advantage),
        ):
            try:
                choose(choice)
            except (ImportError, AttributeError, TypeError) as exc:
                # a dotted path that is not there, or not a plug-in of this kind
                raise ValueError(f"{variable}={choice.name!r}: {exc}") from None
        return self

    @model_validator(mode="after")
    def _eval_task_names_its_sources(self) -> TrainerSettings:
        if not schedule_sources(self.evaluated_task):  # a malformed weight raises here
            raise ValueError(f"SF_TRAINER_EVAL_TASK={self.evaluated_task!r} names no task")
        return self

    @property
    def evaluated_task(self) -> str:
        """What is evaluated: ``eval_task``, or the run's task."""
        return self.eval_task or self.task

    def eval_tasks(self) -> list[str]:
        """The task sources evaluated, in order, each once: a list, or a run's whole
        task schedule (``a:10,a+b`` -> ``a``, ``b``)."""
        return schedule_sources(self.evaluated_task)

    @model_validator(mode="after")
    def _precision_from_the_hardware(self) -> TrainerSettings:
        # resolved once, here: every reader of ``precision`` sees fp32 or bf16-mixed
        choice = resolve_precision(self.precision, self.device)
        self.precision = choice.chosen
        self._precision_choice = choice
        return self

    @property
    def precision_choice(self) -> PrecisionChoice:
        """What ``precision`` was resolved to and why (the trainer logs it at start)."""
        return self._precision_choice

    @model_validator(mode="after")
    def _overlong_window_fits(self) -> TrainerSettings:
        if self.overlong_cache_tokens > self.overlong_max_tokens:
            raise ValueError("overlong_cache_tokens must not exceed overlong_max_tokens")
        return self
