"""The policy as every rank holds it (model shard, optimizer) and the work done on it.

Rank 0 (the mesh member, ``sf_trainer.service``) drives; the other ranks follow. Every
operation in which all ranks take part is a :data:`Command`: rank 0 broadcasts it,
then runs it; a follower receives it, then runs it. So every rank issues the same
collectives in the same order, which is what keeps them from deadlocking. Rank 0 must
call the Learner from one thread at a time (the service uses one worker thread).

Commands cross only the trainer's own process group (torch.distributed), never NATS.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import torch

from seamlessflow.assets.loading import check_tied, load_causal_lm
from seamlessflow.assets.model_check import ModelNeeds, check_model
from seamlessflow.heap import compact_heap
from seamlessflow.protocol import TensorSpec, TrainBatch, WeightManifest
from seamlessflow.residency import Residency, Transition, resizable_parameters
from seamlessflow.weights.codec import BucketSink, EncodedWeights, WeightEncoder
from seamlessflow.weights.layout import dtype_name, layout_bytes, layout_of, torch_dtype
from seamlessflow.weights.tied import tied_aliases, with_aliases, without_aliases
from sf_trainer import checkpoint
from sf_trainer.advantages import chosen_estimator
from sf_trainer.checkpoint import TrainerState
from sf_trainer.distributed import TrainGroup
from sf_trainer.evaluation import EvalResult, EvalSet, evaluate
from sf_trainer.logprobs import chunked_head_refusal
from sf_trainer.losses import chosen_loss
from sf_trainer.memory import (
    LayerShape,
    activation_bytes_per_token,
    auto_micro_batch_tokens,
    free_memory_bytes,
)
from sf_trainer.schedule import lr_at
from sf_trainer.settings import TrainerSettings
from sf_trainer.sharded_loading import materialize_own_shards, model_on_meta
from sf_trainer.step import StepResult, train_step
from sf_trainer.threads import ThreadBudget

if TYPE_CHECKING:
    from transformers import PreTrainedModel

log = logging.getLogger(__name__)

MASTER_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
"""``SF_TRAINER_MASTER_DTYPE`` -> the dtype of the weights the optimizer updates: bf16
is then also what forward and backward compute in; with float32 masters, ``precision``
says (sf_trainer.distributed.forward_precision, TrainGroup.shard)."""


class Step(msgspec.Struct, tag="step"):
    """Take one optimizer step on ``batch``; the policy was published as ``version``;
    ``step`` is the step's index in the run (0-based), which sets its learning rate."""

    batch: TrainBatch
    version: int
    step: int


class GatherWeights(msgspec.Struct, tag="gather_weights"):
    """Gather the full weights on rank 0 as one state dict (``Learner.full_weights``:
    tests and tools; a published version is gathered by ``StreamWeights``)."""


class StreamWeights(msgspec.Struct, tag="stream_weights"):
    """Gather the full weights tensor by tensor on rank 0, into a weight payload or
    bucket by bucket to the stores (``encode_weights``, ``stream_weights``)."""

    dtype: str = ""
    """The floating-point tensors' travel dtype (a torch dtype name; empty: as trained)."""


class GatherCheckpoint(msgspec.Struct, tag="gather_checkpoint"):
    """Gather the full weights and optimizer state on rank 0 (to write a checkpoint)."""


class Restore(msgspec.Struct, tag="restore"):
    """Load the weights and optimizer state rank 0 read from a checkpoint."""


class Evaluate(msgspec.Struct, tag="evaluate"):
    """Evaluate the policy on the held-out split (``sf_trainer.evaluation``)."""


class Stop(msgspec.Struct, tag="stop"):
    """Rank 0 is done: followers return."""


class Offload(msgspec.Struct, tag="offload"):
    """The slots are lent: move parameters and optimizer state to host memory."""


class Reload(msgspec.Struct, tag="reload"):
    """The slots are back: bring what ``Offload`` moved back to the device."""


Command = (
    Step
    | GatherWeights
    | StreamWeights
    | GatherCheckpoint
    | Restore
    | Evaluate
    | Offload
    | Reload
    | Stop
)


class Learner:
    """Model and optimizer of one rank, built the same way on every rank; with a KL
    term (``SF_TRAINER_KL_COEF`` > 0) also the frozen reference model, sharded the same
    way."""

    def __init__(
        self, settings: TrainerSettings, group: TrainGroup, model_dir: Path, seed: int = 0
    ) -> None:
        """``seed``: the run's (``SF_SEED``): torch's, and the evaluation split's."""
        # a misspelt plug-in name or key fails here, at start, not at the first batch
        # (the settings check them too, unless built without validation)
        chosen_estimator(settings.advantage)
        chosen_loss(settings.loss)
        if settings.compact_heap and compact_heap():
            log.info("glibc heap: fixed mmap threshold, one arena (SF_TRAINER_COMPACT_HEAP)")
        torch.set_num_threads(settings.torch_threads)
        torch.manual_seed(seed)
        self.settings = settings
        self.group = group
        self.model_dir = model_dir
        self.bf16_mixed = settings.precision == "bf16-mixed"
        # every rank, before loading: one line naming all the model lacks (exit 78)
        check_model(model_dir, ModelNeeds(chat=False))
        self.master_dtype = MASTER_DTYPES[settings.master_dtype]
        # one process loads the model whole; several ranks build it on the meta device
        # and each reads only its own shard (sf_trainer.sharded_loading)
        model = (
            model_on_meta(model_dir, self.master_dtype)
            if group.distributed
            else load_causal_lm(model_dir, self.master_dtype)
        )
        model.train()
        refusal = chunked_head_refusal(model)
        if settings.logprob_chunk_tokens and refusal is not None:
            log.warning("logprobs from whole logits (SF_TRAINER_LOGPROB_CHUNK_TOKENS "
                        "does not apply): %s", refusal)  # fmt: skip
        if settings.gradient_checkpointing:
            # non-reentrant: works with FSDP2's hooks and with inputs that need no grad
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
        if settings.cpu_offload and not (group.distributed and group.device.type == "cuda"):
            log.info("SF_TRAINER_CPU_OFFLOAD changes nothing here (%s, %d rank(s)): it keeps "
                     "the FSDP2 shards of CUDA ranks on the host", group.device,
                     group.world_size)  # fmt: skip
        self.tied = tied_aliases(model.state_dict(keep_vars=True))
        """{alias: name} of tied matrices: published and checkpointed once, under the
        first name (``seamlessflow.weights.tied``)."""
        self.offloads = settings.offload_when_lent == "on" or (
            settings.offload_when_lent == "auto" and group.device.type == "cuda"
        )
        """Whether ``offload`` moves anything (``SF_TRAINER_OFFLOAD_WHEN_LENT``)."""
        self._residency: Residency | None = None
        """What offloads move, kept from one lend to the next while the tensors stay the
        same (the optimizer's state appears at its first step): on CUDA with its pinned
        host copies, which are slow to allocate (a CPU frees its copies instead: they
        are the same memory the offload would free)."""
        self.model = self._placed(model)
        self.threads: ThreadBudget | None = None
        """One rank on the CPU: it may train on cores lent by idle rollout engines
        (``sf_trainer.threads``). Not with several ranks: they step together, so one
        rank's extra threads would only wait at the next collective."""
        if group.world_size == 1 and group.device.type == "cpu":
            self.threads = ThreadBudget(settings.torch_threads)
            self.threads.install(self.model)
        self.reference = self._reference() if settings.kl_coef > 0 else None
        if not settings.micro_batch_tokens:
            self.settings = settings.model_copy(
                update={"micro_batch_tokens": self._micro_batch_tokens(model.config)}
            )
        self.eval_set = EvalSet.from_settings(settings, seed) if settings.eval_every else None
        self.next_step = 0
        """Index in the run of the next step when the caller does not name it: counts
        this Learner's steps, from the step a restored checkpoint was taken at."""
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(),
            lr=settings.lr,
            betas=settings.betas,
            weight_decay=settings.weight_decay,
            **({"fused": True} if settings.fused_optimizer else {"foreach": True}),
        )

    def _micro_batch_tokens(self, config: Any) -> int:
        """The automatic micro-batch budget (``sf_trainer.memory``), decided by rank 0
        from its memory free now: every rank must plan the same passes."""
        chosen = b""
        if self.group.is_leader:
            compute_bytes = 2 if self.bf16_mixed or self.master_dtype == torch.bfloat16 else 4
            per_token = activation_bytes_per_token(
                LayerShape.of(config), compute_bytes, self.settings.gradient_checkpointing
            )
            ranks_on_the_host = int(os.environ.get("LOCAL_WORLD_SIZE", self.group.world_size))
            # every policy's trainer sees the same "available" at its start: plan on a share
            sharing = ranks_on_the_host * self.settings.trainers_on_host
            free = free_memory_bytes(self.group.device, sharing)
            tokens = auto_micro_batch_tokens(per_token, free)
            log.info("micro-batches of %d tokens (auto: %.2f MB of activations a token, "
                     "%.1f GB free to this rank; SF_TRAINER_MICRO_BATCH_TOKENS sets it)",
                     tokens, per_token / 1e6, free / 1e9)  # fmt: skip
            chosen = str(tokens).encode()
        return int(self.group.broadcast_bytes(chosen))

    def _placed(self, model: PreTrainedModel) -> PreTrainedModel:
        """``model`` on this rank's device, sharded with several ranks; a model built
        on the meta device is then filled with this rank's shard of the weights."""
        model = self.group.shard(
            model,
            bf16_mixed=self.bf16_mixed,
            cpu_offload=self.settings.cpu_offload,
            # bf16 storage, float32 arithmetic: what a CPU without native bf16 can run
            float32_compute=self.master_dtype == torch.bfloat16 and not self.bf16_mixed,
            vocab_parallel=self._splits_vocabulary(model),
        )
        if self.group.distributed:
            materialize_own_shards(model, self.model_dir, self.group.device, self.tied)
            check_tied(model)
        if self.offloads:
            # a CPU model read in its file's dtype lies in the file's mapping, which
            # cannot be freed in place
            resizable_parameters(model)
        return model

    def _splits_vocabulary(self, model: PreTrainedModel) -> bool:
        """Whether the embeddings are split by vocabulary rows (``SF_TRAINER_VOCAB_PARALLEL``):
        only where the logprobs come chunk by chunk from the head (the split head gives
        whole logits only without grad), and not with the shards offloaded to the host
        (the split rows would stay on the device)."""
        settings = self.settings
        return (
            settings.vocab_parallel
            and self.group.distributed
            and settings.logprob_chunk_tokens > 0
            and chunked_head_refusal(model) is None
            and not (settings.cpu_offload and self.group.device.type == "cuda")
        )

    def _reference(self) -> PreTrainedModel:
        """The base model as the KL term's reference: frozen (no grad, never in a
        checkpoint or an optimizer), in eval mode, sharded like the policy, in its
        precision (its forward all-gathers on every rank, in the same passes as the
        policy's)."""
        model = (
            model_on_meta(self.model_dir, self.master_dtype)
            if self.group.distributed
            else load_causal_lm(self.model_dir, self.master_dtype)
        )
        model.eval()
        model.requires_grad_(False)
        return self._placed(model)

    # rank 0 ------------------------------------------------------------------------

    def step(self, batch: TrainBatch, version: int, step: int | None = None) -> StepResult:
        """One optimizer step; ``step``: its index in the run (default ``next_step``),
        which sets the learning rate (``sf_trainer.schedule``)."""
        command = Step(batch=batch, version=version, step=self.next_step if step is None else step)
        self._announce(command)
        result = self._step(command)
        if self.reference is not None:
            # also in TrainStepMetrics.kl_mean; the log shows it beside the coefficient
            log.info("step on version %d: KL to the reference %.6f (coef %g)",
                     version, result.kl_mean, self.settings.kl_coef)  # fmt: skip
        return result

    def full_weights(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """The unsharded weights, a CPU copy (the state published as a version), its
        floating-point tensors in ``dtype`` if given (the weights' travel dtype)."""
        self._announce(GatherWeights())
        return without_aliases(self.group.full_model_state(self.model, dtype), self.tied)

    def encode_weights(
        self, encoder: WeightEncoder, version: int, dtype: torch.dtype | None = None
    ) -> EncodedWeights:
        """The weights published as ``version``, gathered one tensor at a time straight
        into ``encoder``'s payload (floating-point tensors in ``dtype``): no whole copy of
        the model exists on rank 0 beside the payload."""
        layout, tensors = self._version_tensors(dtype)
        return encoder.encode_stream(version, layout, tensors)

    def version_bytes(self, dtype: torch.dtype | None = None) -> int:
        """The size of a published version's payload (floating-point tensors in
        ``dtype``), from the weights' metadata: nothing is gathered."""
        return layout_bytes(layout_of(self.group.host_layout(self.model, dtype, skip=self.tied)))

    def stream_weights(
        self,
        encoder: WeightEncoder,
        version: int,
        dtype: torch.dtype | None,
        sink: BucketSink,
    ) -> WeightManifest:
        """``encode_weights``, handed to ``sink`` bucket by bucket as the tensors are
        gathered (``WeightEncoder.encode_buckets``): rank 0 holds one tensor and two
        buckets of the version at a time, never its payload."""
        layout, tensors = self._version_tensors(dtype)
        with _gathers_finished(tensors):
            return encoder.encode_buckets(version, layout, tensors, sink)

    def pack_weights(
        self, encoder: WeightEncoder, version: int, dtype: torch.dtype | None
    ) -> tuple[WeightManifest, list[torch.Tensor]]:
        """``stream_weights`` packed where rank 0 computes (``WeightEncoder.pack_buckets``,
        for ``cuda_ipc``): each tensor cast and copied on the device into its buckets,
        none brought to the host. The other ranks run the same gathers (``StreamWeights``)."""
        layout, tensors = self._version_tensors(dtype, on_device=True)
        with _gathers_finished(tensors):
            return encoder.pack_buckets(version, layout, tensors, self.group.device)

    def _version_tensors(
        self, dtype: torch.dtype | None, on_device: bool = False
    ) -> tuple[list[TensorSpec], Iterator[tuple[str, torch.Tensor]]]:
        """A version's layout and its tensors as rank 0 gathers them (``host_tensors``),
        the other ranks told to run the same gathers (``StreamWeights``)."""
        self._announce(StreamWeights(dtype=dtype_name(dtype) if dtype is not None else ""))
        layout = layout_of(self.group.host_layout(self.model, dtype, skip=self.tied))
        tensors = self.group.host_tensors(self.model, dtype, skip=self.tied, on_device=on_device)
        return layout, tensors

    def save(self, out: Path, state: TrainerState) -> Path:
        self._announce(GatherCheckpoint())
        model_state, optimizer_state = self._gather_checkpoint()
        return checkpoint.save(
            out, self.model, model_state, optimizer_state, state, tokenizer_dir=self.model_dir
        )

    def restore(self, path: Path) -> TrainerState:
        """Weights and optimizer state from ``path``; the hyperparameters stay the
        settings' (a restart may change the learning rate)."""
        # read before announcing: a bad checkpoint fails here, not with the others waiting
        state = checkpoint.read_state(path)
        model_state = checkpoint.load_model_state(path)
        optimizer_state = checkpoint.load_optimizer_state(path)
        self._announce(Restore())
        self._load(model_state, optimizer_state)
        self.next_step = state.step
        log.info("resumed from %s: step %d, version %d, data position %d",
                 path, state.step, state.version, state.data_position)  # fmt: skip
        return state

    def evaluate(self) -> EvalResult:
        """The policy on the held-out split (needs ``SF_EVAL_EVERY`` > 0)."""
        self._announce(Evaluate())
        return self._evaluate()

    def offload(self) -> Transition | None:
        """The slots are lent: every rank's parameters and optimizer state to host memory
        (``seamlessflow.residency``); None when offloading is off or already done. Any
        other command reloads first."""
        if not self.offloads or self.offloaded:
            return None
        self._announce(Offload())
        return self._offload()

    def reload(self) -> Transition | None:
        """Undo ``offload`` on every rank; None when nothing is offloaded."""
        if not self.offloaded:
            return None
        self._announce(Reload())
        return self._reload()

    @property
    def offloaded(self) -> bool:
        return self._residency is not None and self._residency.state == "offloaded"

    def stop(self) -> None:
        self._announce(Stop())
        # every rank tears its process group down together: a follower whose peers (and
        # rank 0's TCP store) vanish mid-teardown can abort in gloo's threads at exit
        self.group.barrier()

    def _announce(self, command: Command) -> None:
        if self.offloaded and not isinstance(command, Offload | Reload | Stop):
            self.reload()  # every other command works on the weights where they live
        if self.group.distributed:
            self.group.broadcast_bytes(msgspec.msgpack.encode(command))

    # ranks > 0 ---------------------------------------------------------------------

    def follow(self) -> None:
        """Run rank 0's commands, in its order, until it says stop."""
        decoder = msgspec.msgpack.Decoder(Command)
        while True:
            match decoder.decode(self.group.broadcast_bytes(b"")):
                case Step() as command:
                    self._step(command)
                case GatherWeights():
                    self.group.full_model_state(self.model)
                case StreamWeights(dtype=dtype):
                    travel = torch_dtype(dtype) if dtype else None
                    for _ in self.group.host_tensors(self.model, travel, skip=self.tied):
                        pass  # the gathers are collectives: rank 0 keeps the tensors
                case GatherCheckpoint():
                    self._gather_checkpoint()
                case Restore():
                    self._load({}, {})
                case Evaluate():
                    self._evaluate()
                case Offload():
                    self._offload()
                case Reload():
                    self._reload()
                case Stop():
                    self.group.barrier()
                    return

    # every rank --------------------------------------------------------------------

    def _step(self, command: Step) -> StepResult:
        lr = lr_at(command.step, self.settings)
        for param_group in self.optimizer.param_groups:
            param_group["lr"] = lr
        self.next_step = command.step + 1
        return train_step(
            self.model,
            self.optimizer,
            command.batch,
            self.settings,
            command.version,
            self.group,
            self.reference,
        )

    def _offload(self) -> Transition:
        self.optimizer.zero_grad(set_to_none=True)  # a step leaves none; nothing to keep
        tensors: list[torch.Tensor] = list(self.model.parameters())
        if self.reference is not None:
            tensors += self.reference.parameters()
        for state in self.optimizer.state.values():
            tensors += [value for value in state.values() if isinstance(value, torch.Tensor)]
        device = self.group.device
        if self._residency is None or not self._residency.holds(tensors):
            self._residency = Residency(tensors, device, keep_host_copies=device.type == "cuda")
        transition = self._residency.offload()
        log.info("slots lent: %s", transition.in_words())
        return transition

    def _reload(self) -> Transition:
        assert self._residency is not None
        transition = self._residency.reload()  # raises with the state kept: retryable
        log.info("slots back: %s", transition.in_words())
        return transition

    def _evaluate(self) -> EvalResult:
        if self.eval_set is None:
            raise RuntimeError("evaluation needs SF_EVAL_EVERY > 0")
        return evaluate(self.model, self.model_dir, self.eval_set, self.settings, self.group)

    def _gather_checkpoint(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        return (
            without_aliases(self.group.full_model_state(self.model), self.tied),
            self.group.full_optimizer_state(self.model, self.optimizer),
        )

    def _load(self, model_state: dict[str, torch.Tensor], optimizer_state: dict[str, Any]) -> None:
        # a checkpoint holds a tied matrix once; the loader matches every registered name
        if model_state:
            with_aliases(model_state, self.tied)
        self.group.load_full_state(self.model, self.optimizer, model_state, optimizer_state)
        for param_group in self.optimizer.param_groups:
            param_group.update(
                lr=self.settings.lr,
                betas=self.settings.betas,
                weight_decay=self.settings.weight_decay,
                # a checkpoint names the kernel it was saved with: the settings' wins
                fused=True if self.settings.fused_optimizer else None,
                foreach=None if self.settings.fused_optimizer else True,
            )


@contextlib.contextmanager
def _gathers_finished(tensors: Iterator[tuple[str, torch.Tensor]]) -> Iterator[None]:
    """On a failure, run ``tensors`` to its end before raising: the other ranks take
    part in every gather (a collective) and would wait for the rest."""
    try:
        yield
    except BaseException:
        for _ in tensors:
            pass
        raise
