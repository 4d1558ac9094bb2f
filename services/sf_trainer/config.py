from pydantic_settings import BaseSettings, SettingsConfigDict


class TrainerSettings(BaseSettings):
    """trainer settings (env prefix ``SF_TRAINER_``)."""

    model_config = SettingsConfigDict(
        env_prefix="SF_TRAINER_", extra="ignore", use_attribute_docstrings=True
    )

    steps: int = 100
    """Optimizer steps (one batch each); the trainer finishes after this many."""

    lr: float = 1e-4
    """AdamW learning rate (constant)."""

    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW betas (SRPO's choice)."""

    weight_decay: float = 0.0
    """AdamW weight decay."""

    max_grad_norm: float = 1.0
    """Gradient clipping by global norm."""

    loss: str = "grpo_decoupled"
    """Policy loss plug-in (``sf_trainer.losses``): ``grpo`` (PPO-clip against the
    behaviour logprobs) or ``grpo_decoupled`` (decoupled PPO + truncated IS)."""

    is_cap: float = 2.0
    """Truncation of the behaviour importance weight in ``grpo_decoupled``."""

    clip_eps: float = 0.2
    """PPO ratio clip: the ratio is kept within [1 - eps, 1 + eps]."""

    temperature: float = 1.0
    """Sampling temperature the agents use; logprobs are computed at this temperature
    so they match the engine's behaviour logprobs."""

    micro_batch_tokens: int = 16384
    """Gradient accumulation: each rank's sequences are packed into micro-batches of at
    most this many (padded) tokens: rows x the longest row."""

    checkpoint_every: int = 0
    """Also checkpoint every N steps (0 = only at the end and on stop). A resume loses
    the steps after the checkpoint it starts from."""

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

    seed: int = 0
    """torch seed."""

    torch_threads: int = 1
    """torch intra-op threads."""
