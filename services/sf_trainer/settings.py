"""The trainer's settings (``SF_TRAINER_*``)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator
from pydantic_settings import SettingsConfigDict

from seamlessflow.runfile import RunFileSettings


class TrainerSettings(RunFileSettings):
    """trainer settings (env prefix ``SF_TRAINER_``)."""

    model_config = SettingsConfigDict(
        env_prefix="SF_TRAINER_", extra="ignore", use_attribute_docstrings=True
    )

    steps: int = 100
    """Optimizer steps (one batch each); the trainer finishes after this many. Steps a
    resume lost (taken after the checkpoint it resumes from) count: their batches are
    not trained again. The policy's step budget: the trainer announces it at start
    (``TrainingPlanned``) and the trajectory service dispatches for it."""

    lr: float = 1e-4
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

    precision: Literal["fp32", "bf16-mixed"] = "fp32"
    """Compute precision of forward and backward. ``fp32``: everything in float32.
    ``bf16-mixed``: master weights, gradients as the optimizer sees them and the AdamW
    state stay float32; forward and backward run in bfloat16 (one process: autocast;
    several ranks: FSDP2's ``MixedPrecisionPolicy`` with bf16 parameters, gradients
    reduced in float32). Logprobs are taken in float32 from the bf16 logits, so they
    differ from the engine's by bf16 rounding (``logprob_abs_diff`` shows it)."""

    gradient_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward pass instead of
    keeping them (HF gradient checkpointing, non-reentrant): less memory, about one more
    forward per step; the gradients are the same."""

    eval_every: int = Field(default=0, ge=0)
    """Evaluate the policy on ``eval_task``'s held-out split every N steps, after the
    step's version is published (a ``TrainEvalMetrics`` record, also in
    ``metrics.jsonl``); 0 = never."""

    eval_task: str = "arithmetic"
    """Task source (``seamlessflow.tasks``) whose ``eval`` split is evaluated, built with
    the run's seed (``SF_SEED``: the split depends on it); ``seamlessflow up`` sets it to
    the run's task."""

    eval_items: int = Field(default=64, ge=0)
    """Prompts evaluated: the first N of the eval split (0 = all of it)."""

    eval_max_tokens: int = Field(default=16, ge=1)
    """Completion budget of each evaluated answer (greedy decoding)."""

    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW betas (SRPO's choice)."""

    weight_decay: float = 0.0
    """AdamW weight decay."""

    max_grad_norm: float = 1.0
    """Gradient clipping by global norm."""

    advantage: str = "grpo"
    """Advantage estimator plug-in (``sf_trainer.advantages``): ``grpo`` ((r - mean) /
    (std + 1e-6) within each group), ``dr_grpo`` (r - group mean), ``rloo`` (r - mean of
    the group's other samples), ``reinforce_pp`` ((r - mean) / std over the whole
    batch), ``reinforce_pp_baseline`` (r - group mean, divided by the batch's std of
    those)."""

    loss: str = "grpo_decoupled"
    """Policy loss plug-in (``sf_trainer.losses``): ``grpo_decoupled`` (decoupled PPO +
    truncated IS), ``grpo`` (PPO-clip against the behaviour logprobs), ``dapo``
    (clip-higher), all three a mean over the batch's tokens; ``dr_grpo`` (``grpo``'s
    terms, token sum / (sequences x ``DR_GRPO_TOKENS``)); ``gspo`` (sequence-level ratio
    and clip, mean over sequences)."""

    is_cap: float = 2.0
    """Truncation of the behaviour importance weight in ``grpo_decoupled``."""

    clip_eps: float = 0.2
    """PPO ratio clip of ``grpo``, ``grpo_decoupled`` and ``dr_grpo``: the ratio is kept
    within [1 - eps, 1 + eps]."""

    clip_eps_low: float = 0.2
    """``dapo``: lower ratio clip, 1 - eps."""

    clip_eps_high: float = 0.28
    """``dapo`` (clip-higher): upper ratio clip, 1 + eps."""

    gspo_clip_eps_low: float = 3e-4
    """``gspo``: lower clip of the sequence ratio, 1 - eps (GSPO paper)."""

    gspo_clip_eps_high: float = 4e-4
    """``gspo``: upper clip of the sequence ratio, 1 + eps (GSPO paper)."""

    dr_grpo_tokens: int = Field(default=0, ge=0)
    """``dr_grpo``: the constant each sequence's token sum is divided by (then by the
    number of sequences); the paper uses the generation budget (max tokens). 0 = the
    batch's longest response in trained tokens."""

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

    micro_batch_tokens: int = 16384
    """Gradient accumulation: each rank's sequences are packed into micro-batches of at
    most this many (padded) tokens: rows x the longest row."""

    logprob_chunk_tokens: int = Field(default=1024, ge=0)
    """Tokens whose logits exist at once when the trainer takes logprobs (policy and
    reference): the final hidden states of the trained tokens go through the output
    embedding and the log-softmax this many tokens at a time, and with more than one
    chunk the backward recomputes each chunk's logits, so memory grows with chunk x
    vocabulary instead of micro-batch x vocabulary (``sf_trainer.logprobs``). 0 = whole
    logits. Models whose head is more than the output embedding (e.g. a final logit
    soft-cap) always use whole logits."""

    checkpoint_every: int = 0
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

    device: str = "cpu"
    """torch device of the policy (``cpu``, ``cuda``, ``cuda:1``). Under torchrun (several
    ranks) only the type counts: rank r uses ``cuda:<LOCAL_RANK>`` with nccl, or the CPU
    with gloo."""

    collective_timeout_s: float = 21600.0
    """Several ranks: the longest any collective may wait, including the other ranks'
    wait for rank 0's next command while it waits for a batch."""

    torch_threads: int = 1
    """torch intra-op threads."""

    @model_validator(mode="after")
    def _overlong_window_fits(self) -> TrainerSettings:
        if self.overlong_cache_tokens > self.overlong_max_tokens:
            raise ValueError("overlong_cache_tokens must not exceed overlong_max_tokens")
        return self
