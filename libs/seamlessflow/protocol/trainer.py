"""A trainer's progress: step metrics, evaluations, its plan and its end (durable)."""

from __future__ import annotations

import time

import msgspec

from seamlessflow.protocol.base import DEFAULT_POLICY, Message


class TrainStepMetrics(Message, tag="train.metrics"):
    """trainer -> trajectory (pacing), observers, and itself on restart (JetStream):
    what one optimizer step did."""

    step: int
    version: int
    batch_index: int
    mean_reward: float
    loss: float
    clip_fraction: float
    samples: int
    tokens_generated: int
    tokens_trained: int
    max_staleness: int
    step_seconds: float
    wait_seconds: float
    publish_seconds: float
    staleness_histogram: dict[int, int] = msgspec.field(default_factory=dict)
    """Trained tokens by version gap (trained version - generating version)."""
    logprob_abs_diff: float = 0.0
    """Mean |trainer - behaviour| logprob over trained tokens."""
    truncated_fraction: float = 0.0
    """Fraction of trained tokens whose importance weight was truncated."""
    kl_mean: float = 0.0
    """Mean k3 KL to the reference model over trained tokens (0 without ``KL_COEF``)."""
    weights_kind: str = ""
    """``full`` or ``delta``: how this step's weights were sent."""
    weights_payload_bytes: int = 0
    """Bytes this version put on the wire (per receiver); the full state is
    ``weights_state_bytes``."""
    weights_state_bytes: int = 0
    lr: float = 0.0
    """The learning rate this step used (``SF_TRAINER_LR_SCHEDULE``); 0: not recorded."""
    grad_norm: float = 0.0
    """Global gradient norm before clipping (``SF_TRAINER_MAX_GRAD_NORM``), over every
    rank's gradient."""
    reward_std: float = 0.0
    """Standard deviation of the batch's sample rewards (population: divided by the
    sample count), unshaped like ``mean_reward``."""
    reward_min: float = 0.0
    """Lowest sample reward of the batch."""
    reward_max: float = 0.0
    """Highest sample reward of the batch."""
    completion_tokens_mean: float = 0.0
    """Mean per sample of the tokens the policy generated and is trained on (loss mask
    1), summed over the turns of a multi-turn sample."""
    completion_tokens_max: int = 0
    """Most such tokens of one sample."""
    prompt_tokens_mean: float = 0.0
    """Mean per sample of the tokens the policy did not generate (loss mask 0): the
    prompt, and in a multi-turn sample the tool results and other context between its
    turns (a constrained-decoding turn, never trained, counts here too)."""
    entropy_mean: float = 0.0
    """Mean over trained tokens of the entropy (nats) of the policy's next-token
    distribution, at each token's sampling temperature (1 for greedy tokens, like their
    logprobs), under the weights the step started from."""
    mean_staleness: float = 0.0
    """Mean version gap of the trained tokens (``staleness_histogram``, token-weighted)."""
    completions_truncated_fraction: float = 0.0
    """Fraction of the samples whose last generation stopped at its token budget
    (``TrainSample.finish_reason`` ``length``); 0 for samples that do not say."""
    lent_thread_seconds: float = 0.0
    """Thread-seconds the step ran on cores lent by idle rollout engines (CoresLent),
    beyond the trainer's own threads."""
    policy: str = DEFAULT_POLICY
    timestamp: float = msgspec.field(default_factory=time.time)


class TrainEvalMetrics(Message, tag="train.eval"):
    """trainer -> observers (JetStream): the policy of one version evaluated on a task's
    held-out split (``SF_EVAL_EVERY``): greedy answers, mean reward."""

    step: int
    """Steps taken when evaluated (the step that published ``version``)."""
    version: int
    task: str
    split: str
    samples: int
    """Prompts evaluated, one greedy answer each."""
    mean_reward: float
    """Mean reward of the answers (the accuracy for a 0/1 reward); over several tasks
    (``task`` lists them by comma), the mean of the tasks' means."""
    max_tokens: int
    eval_seconds: float
    policy: str = DEFAULT_POLICY
    timestamp: float = msgspec.field(default_factory=time.time)
    by_task: dict[str, float] = msgspec.field(default_factory=dict)
    """Several tasks evaluated: each one's mean reward over its own prompts."""


class TrainingPlanned(Message, tag="train.plan"):
    """trainer -> trajectory and observers (JetStream), at each start: the policy's step
    budget (``SF_STEPS``), which the trajectory service dispatches for, and the
    run's seed (``SF_SEED``), which every service must share."""

    steps: int
    seed: int
    policy: str = DEFAULT_POLICY


class TrainingFinished(Message, tag="train.finished"):
    """trainer -> trajectory and observers (JetStream): the run reached its step budget."""

    steps: int
    final_version: int
    checkpoint_dir: str
    policy: str = DEFAULT_POLICY


TrainProgress = TrainStepMetrics | TrainEvalMetrics | TrainingPlanned | TrainingFinished
"""Every message of ``Subjects.train_all()`` (a trainer's progress, for observers)."""
