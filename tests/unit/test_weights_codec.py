"""The shared weight-transfer logic: layout, buckets, deltas, encoder schedule and the
receiver's refusal of anything partial or wrong (docs/architecture.md, invariant 5), on
real torch tensors."""

from __future__ import annotations

import subprocess
import sys

import msgspec
import numpy as np
import pytest
import torch

from seamlessflow.weights import (
    VersionChain,
    VersionGap,
    WeightEncoder,
    WeightMirror,
    WeightsCorrupted,
)
from seamlessflow.weights import delta as delta_codec
from seamlessflow.weights.layout import ALIGNMENT, LayoutMismatch, flatten, tensor_views


def model_state(seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(300, 64, generator=generator).bfloat16(),
        "norm.weight": torch.randn(64, generator=generator),  # float32 among bf16
        "scale": torch.tensor(0.5),  # 0-dim
        "head.weight": torch.randn(7, 9, generator=generator).bfloat16(),
    }


def one_step(state: dict[str, torch.Tensor], fraction: float, seed: int) -> dict[str, torch.Tensor]:
    """Change about ``fraction`` of the elements, like an optimizer step in bf16."""
    generator = torch.Generator().manual_seed(seed)
    stepped = {}
    for name, tensor in state.items():
        flat = tensor.clone().reshape(-1)
        chosen = torch.rand(flat.numel(), generator=generator) < fraction
        flat[chosen] += 1.0
        stepped[name] = flat.reshape(tensor.shape)
    return stepped


def assert_same_state(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        assert torch.equal(got[name], tensor), name


def test_flat_layout_round_trips_mixed_dtypes_and_aligns_every_tensor() -> None:
    state = model_state()
    flat, layout = flatten(state)
    assert all(spec.offset % ALIGNMENT == 0 for spec in layout)
    assert flat.numel() % ALIGNMENT == 0
    assert_same_state(tensor_views(flat, layout), state)
    with pytest.raises(LayoutMismatch):
        flatten_state = dict(state)
        flatten_state["norm.weight"] = flatten_state["norm.weight"].bfloat16()
        from seamlessflow.weights.layout import flatten_into

        flatten_into(flat.clone(), flatten_state, layout)


@pytest.mark.parametrize("fraction", [0.001, 0.2])
def test_a_delta_rebuilds_the_new_state_exactly(fraction: float) -> None:
    """Sparse changes travel as indices, denser ones as a bitmap; both rebuild the state."""
    old_flat, _ = flatten(model_state())
    new_flat, _ = flatten(one_step(model_state(), fraction, seed=1))
    found = delta_codec.encode(old_flat.numpy(), new_flat.numpy(), word=2)
    assert found is not None
    encoding, payload = found
    assert encoding.positions == ("indices" if fraction < 0.01 else "bitmap")
    changed = int((old_flat.numpy().view(np.uint16) != new_flat.numpy().view(np.uint16)).sum())
    assert encoding.changed_words == changed
    assert len(payload) < new_flat.numel()
    patched = old_flat.clone()
    delta_codec.apply(patched.numpy(), encoding, payload)
    assert torch.equal(patched, new_flat)


def test_a_delta_that_would_not_save_enough_is_not_made() -> None:
    old_flat, _ = flatten(model_state())
    new_flat, _ = flatten(one_step(model_state(), 0.9, seed=1))
    assert delta_codec.encode(old_flat.numpy(), new_flat.numpy(), word=2, max_ratio=0.5) is None


def test_a_delta_with_an_index_outside_the_state_changes_nothing() -> None:
    old_flat, _ = flatten(model_state())
    new_flat, _ = flatten(one_step(model_state(), 0.001, seed=2))
    found = delta_codec.encode(old_flat.numpy(), new_flat.numpy(), word=2)
    assert found is not None
    encoding, payload = found
    forged = bytearray(payload)
    forged[0:4] = np.array([old_flat.numel()], dtype=np.uint32).tobytes()  # past the end
    target = old_flat.clone()
    with pytest.raises(delta_codec.DeltaCorrupted):
        delta_codec.apply(target.numpy(), encoding, bytes(forged))
    assert torch.equal(target, old_flat)


def test_encoder_sends_full_first_then_deltas_then_full_every_n_and_after_a_gap() -> None:
    encoder = WeightEncoder(bucket_bytes=4096, deltas=True, full_every=3)
    state = model_state()
    kinds = []
    for version in (1, 2, 3, 4, 5, 7, 8):  # 6 is skipped: a gap
        state = one_step(state, 0.001, seed=version)
        encoded = encoder.encode(version, state)
        kinds.append(encoded.manifest.kind)
        if encoded.manifest.kind == "delta":
            assert encoded.manifest.base_version == version - 1
            assert encoded.manifest.payload_bytes < encoded.manifest.state_bytes / 10
    assert kinds == ["full", "delta", "delta", "full", "delta", "full", "delta"]


def test_encoder_without_deltas_and_after_a_layout_change_sends_full() -> None:
    plain = WeightEncoder(bucket_bytes=4096, deltas=False)
    assert [plain.encode(v, model_state()).manifest.kind for v in (1, 2)] == ["full", "full"]
    encoder = WeightEncoder(bucket_bytes=4096, deltas=True)
    encoder.encode(1, model_state())
    grown = dict(model_state())
    grown["extra"] = torch.zeros(3)
    assert encoder.encode(2, grown).manifest.kind == "full"


def test_versions_after_a_layout_change_are_encoded_in_their_own_layout() -> None:
    """The encoder reuses the buffer of two versions ago only if it has the new layout
    (after fp32 -> bf16 it used to reuse the fp32-sized one: the next delta raised)."""
    encoder = WeightEncoder(bucket_bytes=4096, deltas=True, full_every=100)
    mirror = WeightMirror()
    state = model_state()
    kinds = []
    for version, dtype in enumerate([None, None, torch.float32, torch.float32, None, None], 1):
        state = one_step(state, 0.001, seed=version)
        sent = state if dtype is None else {k: v.to(dtype) for k, v in state.items()}
        encoded = encoder.encode(version, sent)
        assert encoded.manifest.payload_bytes <= encoded.manifest.state_bytes
        kinds.append(encoded.manifest.kind)
        mirror.apply(encoded.manifest, encoded.payload)
        assert_same_state(mirror.tensors(), sent)
    assert kinds == ["full", "delta", "full", "delta", "full", "delta"]


@pytest.mark.parametrize("names", ["one tensor", "two copies", "input name only"])
def test_a_tied_matrix_travels_under_the_names_it_was_given(names: str) -> None:
    """A tied model's state dict lists its one matrix under two names (the same tensor
    from ``state_dict()``, or two copies from a gathered state) or one name
    (``named_parameters()``); full and delta versions rebuild exactly that."""
    generator = torch.Generator().manual_seed(0)
    matrix = torch.randn(64, 16, generator=generator)
    norm = torch.ones(16)
    encoder = WeightEncoder(bucket_bytes=1000, deltas=True, full_every=100)
    mirror = WeightMirror()
    for version in (1, 2, 3):
        with torch.no_grad():
            matrix[version::8] += 1.0  # a few rows per step: a delta
        state = {"model.embed_tokens.weight": matrix, "model.norm.weight": norm}
        if names == "one tensor":
            state["lm_head.weight"] = matrix
        elif names == "two copies":
            state["lm_head.weight"] = matrix.clone()
        encoded = encoder.encode(version, state)
        assert encoded.manifest.kind == ("full" if version == 1 else "delta")
        mirror.apply(encoded.manifest, encoded.payload)
        got = mirror.tensors()
        assert got.keys() == state.keys()
        assert_same_state(got, state)
        if names != "input name only":
            assert torch.equal(got["lm_head.weight"], got["model.embed_tokens.weight"])


def test_mirror_follows_full_and_deltas_across_buckets_smaller_than_a_tensor() -> None:
    """Buckets of 1000 bytes: the 38 KB embedding spans many of them."""
    encoder = WeightEncoder(bucket_bytes=1000, deltas=True, full_every=100)
    mirror = WeightMirror()
    state = model_state()
    for version in range(1, 6):
        state = one_step(state, 0.01, seed=version)
        encoded = encoder.encode(version, state)
        assert len(encoded.manifest.bucket_digests) == -(-encoded.manifest.payload_bytes // 1000)
        mirror.apply(encoded.manifest, encoded.payload)
        assert mirror.version == version
        assert_same_state(mirror.tensors(), state)


def test_mirror_refuses_a_corrupted_bucket_and_keeps_what_it_served() -> None:
    encoder = WeightEncoder(bucket_bytes=1000, deltas=True)
    mirror = WeightMirror()
    first = encoder.encode(1, model_state())
    mirror.apply(first.manifest, first.payload)
    second = encoder.encode(2, one_step(model_state(), 0.01, seed=3))
    corrupted = bytearray(second.payload)
    corrupted[len(corrupted) // 2] ^= 0xFF
    with pytest.raises(WeightsCorrupted):
        mirror.apply(second.manifest, bytes(corrupted))
    with pytest.raises(WeightsCorrupted):
        mirror.apply(second.manifest, bytes(second.payload)[:-1])  # truncated
    assert mirror.version == 1
    assert_same_state(mirror.tensors(), model_state())


def test_mirror_refuses_a_delta_whose_result_does_not_match_the_announced_state() -> None:
    """A sender bug (a delta computed against the wrong base) is caught after applying;
    the mirror then holds nothing rather than an unknown state."""
    encoder = WeightEncoder(bucket_bytes=1000, deltas=True)
    mirror = WeightMirror()
    first = encoder.encode(1, model_state())
    mirror.apply(first.manifest, first.payload)
    second = encoder.encode(2, one_step(model_state(), 0.01, seed=4))
    lying = msgspec.structs.replace(second.manifest, state_digest="0" * 64)
    with pytest.raises(WeightsCorrupted):
        mirror.apply(lying, second.payload)
    assert mirror.version == 0 and mirror.tensors() == {}


def test_a_delta_on_another_version_is_a_gap_and_the_chain_closes_it() -> None:
    encoder = WeightEncoder(bucket_bytes=4096, deltas=True, full_every=100)
    chain = VersionChain()
    state = model_state()
    payloads = {}
    for version in (1, 2, 3):
        state = one_step(state, 0.001, seed=version)
        encoded = encoder.encode(version, state)
        assert chain.extend(encoded.manifest)
        payloads[version] = bytes(encoded.payload)  # the encoder recycles its buffers
    late = WeightMirror()
    with pytest.raises(VersionGap):
        late.plan([chain.manifests[-1]])  # holds nothing: a lone delta cannot help
    steps = late.plan(chain.manifests)
    assert [m.version for m in steps] == [1, 2, 3]
    for manifest in steps:
        late.apply(manifest, payloads[manifest.version])
    assert_same_state(late.tensors(), state)

    halfway = WeightMirror()
    halfway.apply(chain.manifests[0], payloads[1])
    assert [m.version for m in halfway.plan(chain.manifests)] == [2, 3]
    assert halfway.plan(chain.manifests[:1]) == []  # already there


def test_version_chain_accepts_only_what_continues_it() -> None:
    encoder = WeightEncoder(bucket_bytes=4096, deltas=True, full_every=100)
    manifests = [encoder.encode(v, one_step(model_state(), 0.001, seed=v)).manifest for v in (1, 2)]
    chain = VersionChain()
    assert not chain.extend(manifests[1])  # a delta with nothing under it
    assert chain.extend(manifests[0]) and chain.extend(manifests[1])
    assert not chain.extend(manifests[1])  # the same delta again
    assert chain.version == 2
    fresh = WeightEncoder(bucket_bytes=4096).encode(5, model_state()).manifest
    assert chain.extend(fresh) and [m.version for m in chain.manifests] == [5]


def test_version_chain_completes_a_version_whose_fallback_was_pending() -> None:
    """A ``cuda_ipc`` version announced held (its fallback pending) is replaced by the
    same version completed; never the other way round, nor by another version's."""
    from seamlessflow.protocol import DeviceHandle, DevicePayload

    stored = WeightEncoder(bucket_bytes=4096).encode(3, model_state()).manifest
    handles = [DeviceHandle(kind="shm", name=b"b", nbytes=1)]
    device = DevicePayload(buckets=handles, fallback="shm", checksums=[1])
    completed = msgspec.structs.replace(stored, transport="cuda_ipc", device=device)
    pending = msgspec.structs.replace(
        completed,
        bucket_digests=[],
        location="",
        device=msgspec.structs.replace(device, fallback_pending=True),
    )
    assert pending.fallback_pending and not completed.fallback_pending
    chain = VersionChain()
    assert chain.extend(pending) and chain.manifests == [pending]
    assert chain.completes(completed) and chain.extend(completed)
    assert chain.manifests == [completed]
    assert not chain.completes(pending) and not chain.extend(pending)  # not undone
    later = msgspec.structs.replace(completed, version=4)
    assert not VersionChain().completes(completed)
    chain.manifests = [pending]
    assert not chain.completes(later) and chain.extend(later)  # a newer version, as ever


def test_the_weight_sync_service_starts_without_torch() -> None:
    """weight-sync keeps manifests, never tensors: its service module, the package's
    names and its chain import no torch (seconds of CPU at every start and restart)."""
    code = (
        "import sys, sf_weight_sync.service, seamlessflow.weights\n"
        "from seamlessflow.weights import VersionChain\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
        "from seamlessflow.weights import WeightEncoder\n"
        "assert 'torch' in sys.modules and WeightEncoder.__module__.endswith('codec')\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize(
    "lie",
    [
        {"state_bytes": 512},  # a full payload that does not fill the state
        {"layout": []},  # a layout the payload does not match
        {"kind": "delta", "base_version": 1, "delta": None},  # a delta without an encoding
    ],
    ids=["state_bytes", "layout", "no_encoding"],
)
def test_a_manifest_that_contradicts_itself_is_refused_and_changes_nothing(lie: dict) -> None:  # type: ignore[type-arg]
    good = WeightEncoder(bucket_bytes=1 << 20).encode(1, model_state())
    mirror = WeightMirror()
    mirror.apply(good.manifest, good.payload)
    liar = msgspec.structs.replace(good.manifest, version=2, **lie)
    with pytest.raises((WeightsCorrupted, VersionGap)):
        mirror.apply(liar, good.payload)
    assert mirror.version == 1
    assert_same_state(mirror.tensors(), model_state())


def test_bucket_digests_are_each_buckets_xxh3_128() -> None:
    """Checked against xxhash's streaming hasher, fed in odd pieces: the digest of every
    bucket, the short last one too, and the state's digest over them."""
    import xxhash

    from seamlessflow.weights.layout import bucket_digests, bucket_ranges, state_digest

    data = bytes(range(256)) * 1000 + b"tail"
    expected = []
    for start, end in bucket_ranges(len(data), 4096):
        hasher = xxhash.xxh3_128()
        for piece in range(start, end, 1000):
            hasher.update(data[piece : min(piece + 1000, end)])
        expected.append(hasher.hexdigest())
    assert len(expected) == -(-len(data) // 4096)
    assert bucket_digests(data, 4096) == expected
    assert state_digest(expected) == xxhash.xxh3_128("".join(expected).encode()).hexdigest()


def test_a_state_streamed_tensor_by_tensor_encodes_as_the_whole_dict() -> None:
    """``encode_stream`` (a trainer gathering one tensor at a time into the payload) gives
    the payload and manifest of ``encode``; the stream must be exactly the layout's
    tensors, in its order, in its dtypes and shapes."""
    from seamlessflow.weights.layout import layout_of

    state = model_state()
    layout = layout_of((name, t.dtype, list(t.shape)) for name, t in state.items())
    whole = WeightEncoder(bucket_bytes=1000).encode(3, state)
    streamed = WeightEncoder(bucket_bytes=1000).encode_stream(3, layout, iter(state.items()))
    assert streamed.manifest == whole.manifest
    assert bytes(streamed.payload) == bytes(whole.payload)

    items = list(state.items())
    wrong_dtype = [(items[0][0], items[0][1].double()), *items[1:]]
    for stream, problem in (
        (items[::-1], "where the layout has"),
        (items[:-1], f"{len(items) - 1} tensors for a layout of {len(items)}"),
        ([*items, items[0]], "beyond a layout"),
        (wrong_dtype, "float64"),
    ):
        with pytest.raises(LayoutMismatch, match=problem):
            WeightEncoder(bucket_bytes=1000).encode_stream(4, layout, iter(stream))


class KeepingSink:
    """A ``BucketSink`` that copies each bucket and remembers which memory it came in."""

    def __init__(self, lends: bool = False) -> None:
        self.sizes: tuple[int, int] | None = None
        self.buckets: list[bytes] = []
        self.memory: set[int] = set()
        self.ended = False
        self.lends = lends
        self.lent: list[torch.Tensor] = []

    def begin(self, payload_bytes: int, bucket_bytes: int) -> list[torch.Tensor] | None:
        """Lends two buffers of its own (as a push ring lends its slots) when asked to."""
        self.sizes = (payload_bytes, bucket_bytes)
        if not self.lends:
            return None
        self.lent = [torch.full((bucket_bytes,), 0xAB, dtype=torch.uint8) for _ in range(2)]
        return self.lent

    def put(self, index: int, bucket: memoryview) -> None:
        assert index == len(self.buckets)
        self.buckets.append(bytes(bucket))
        self.memory.add(torch.frombuffer(bucket, dtype=torch.uint8).data_ptr())

    def end(self) -> None:
        self.ended = True


@pytest.mark.parametrize("bucket_bytes", [64, 1000, 4096, 38_848, 1 << 20])
def test_a_version_streamed_bucket_by_bucket_has_the_buckets_of_the_whole_payload(
    bucket_bytes: int,
) -> None:
    """``encode_buckets`` (a trainer handing a version to the stores as it is gathered)
    gives the buckets and manifest of ``encode``, for buckets smaller than one tensor, of
    exactly the payload (38,848 bytes: the last bucket is whole) and larger than all of
    it, through two bucket buffers reused whatever the payload's size."""
    from seamlessflow.weights.layout import layout_of

    state = model_state()
    layout = layout_of((name, t.dtype, list(t.shape)) for name, t in state.items())
    whole = WeightEncoder(bucket_bytes=bucket_bytes).encode(3, state)
    assert whole.manifest.payload_bytes == 38_848
    encoder = WeightEncoder(bucket_bytes=bucket_bytes)
    for version in (3, 4):  # the second version reuses the first one's buffers
        sink = KeepingSink()
        manifest = encoder.encode_buckets(version, layout, iter(state.items()), sink)
        assert manifest == msgspec.structs.replace(whole.manifest, version=version)
        assert sink.sizes == (38_848, bucket_bytes) and sink.ended
        assert b"".join(sink.buckets) == bytes(whole.payload)
        assert len(sink.buckets) == len(manifest.bucket_digests)
        assert len(sink.memory) <= 2
    mirror = WeightMirror()
    mirror.apply(manifest, memoryview(b"".join(sink.buckets)))
    assert all(torch.equal(mirror.tensors()[name], state[name]) for name in state)

    items = list(state.items())
    for stream, problem in (
        (items[::-1], "where the layout has"),
        (items[:-1], f"{len(items) - 1} tensors for a layout of {len(items)}"),
        ([*items, items[0]], "beyond a layout"),
    ):
        with pytest.raises(LayoutMismatch, match=problem):
            encoder.encode_buckets(5, layout, iter(stream), KeepingSink())


def test_a_version_streams_into_the_buffers_its_sink_lends() -> None:
    """A sink that lends its memory (a same-host push ring's slots) gets every bucket in
    that memory, the same bytes as in the encoder's own buffers; the encoder allocates
    none of its own."""
    from seamlessflow.weights.layout import layout_of

    state = model_state()
    layout = layout_of((name, t.dtype, list(t.shape)) for name, t in state.items())
    whole = WeightEncoder(bucket_bytes=1000).encode(3, state)
    encoder = WeightEncoder(bucket_bytes=1000)
    sink = KeepingSink(lends=True)
    manifest = encoder.encode_buckets(3, layout, iter(state.items()), sink)
    assert manifest == whole.manifest
    assert b"".join(sink.buckets) == bytes(whole.payload)
    assert sink.memory == {buffer.data_ptr() for buffer in sink.lent}
    assert encoder._bucket_buffers == []


def in_row_blocks(state: dict[str, torch.Tensor], rows: int) -> list[tuple[str, torch.Tensor]]:
    """Every tensor of two dimensions or more as blocks of ``rows`` rows (the last one
    short), as a sharded trainer hands them over; the others whole."""
    pieces: list[tuple[str, torch.Tensor]] = []
    for name, tensor in state.items():
        if tensor.dim() < 2:
            pieces.append((name, tensor))
        else:
            pieces += [(name, block) for block in tensor.split(rows)]
    return pieces


@pytest.mark.parametrize("rows", [1, 7, 128, 300])
def test_a_tensor_may_come_in_blocks_of_its_rows(rows: int) -> None:
    """Row blocks of a tensor (a 300-row embedding in 1-row, 7-row, 128-row blocks, or
    whole) give the payload, buckets and manifest of the whole tensors, streamed or
    encoded into one payload."""
    from seamlessflow.weights.layout import layout_of

    state = model_state()
    layout = layout_of((name, t.dtype, list(t.shape)) for name, t in state.items())
    whole = WeightEncoder(bucket_bytes=1000).encode(3, state)
    sink = KeepingSink()
    manifest = WeightEncoder(bucket_bytes=1000).encode_buckets(
        3, layout, iter(in_row_blocks(state, rows)), sink
    )
    assert manifest == whole.manifest
    assert b"".join(sink.buckets) == bytes(whole.payload)
    streamed = WeightEncoder(bucket_bytes=1000).encode_stream(
        3, layout, iter(in_row_blocks(state, rows))
    )
    assert bytes(streamed.payload) == bytes(whole.payload)


@pytest.mark.parametrize("rows", [7, 300])
def test_a_version_packed_where_it_lives_has_the_streamed_buckets(rows: int) -> None:
    """``pack_buckets`` (``cuda_ipc``: on the trainer's device) writes exactly the bytes
    ``encode_buckets`` hands over, one allocation per bucket of the manifest's sizes, and
    leaves the digests to whoever brings them to the host."""
    from seamlessflow.weights.layout import bucket_ranges, layout_of

    state = model_state()
    layout = layout_of((name, t.dtype, list(t.shape)) for name, t in state.items())
    whole = WeightEncoder(bucket_bytes=1000).encode(3, state)
    manifest, buckets = WeightEncoder(bucket_bytes=1000).pack_buckets(
        3, layout, iter(in_row_blocks(state, rows)), torch.device("cpu")
    )
    ranges = list(bucket_ranges(manifest.payload_bytes, manifest.bucket_bytes))
    assert [b.numel() for b in buckets] == [end - start for start, end in ranges]
    assert len({b.untyped_storage().data_ptr() for b in buckets}) == len(buckets)
    assert b"".join(bytes(b.numpy()) for b in buckets) == bytes(whole.payload)
    assert manifest.bucket_digests == [] and manifest.state_digest != whole.manifest.state_digest
    assert (
        msgspec.structs.replace(
            manifest,
            bucket_digests=whole.manifest.bucket_digests,
            state_digest=whole.manifest.state_digest,
        )
        == whole.manifest
    )
    with pytest.raises(ValueError, match="deltas"):
        WeightEncoder(1000, deltas=True).pack_buckets(3, layout, iter([]), torch.device("cpu"))


def test_buckets_of_the_wrong_sizes_are_refused() -> None:
    from seamlessflow.weights.layout import fill_buckets, layout_of

    state = model_state()
    layout = layout_of((name, t.dtype, list(t.shape)) for name, t in state.items())
    wrong = [torch.empty(1000, dtype=torch.uint8) for _ in range(2)]
    with pytest.raises(ValueError, match="buckets of"):
        fill_buckets(iter(state.items()), layout, wrong)
    with pytest.raises(ValueError, match="no buckets"):
        fill_buckets(iter(state.items()), layout, [])


def test_row_blocks_that_do_not_make_their_tensor_are_refused() -> None:
    from seamlessflow.weights.layout import layout_of

    state = model_state()
    layout = layout_of((name, t.dtype, list(t.shape)) for name, t in state.items())
    embed = state["embed.weight"]
    rest = list(state.items())[1:]
    for pieces, problem in (
        ([("embed.weight", embed[:100]), *rest], "'norm.weight' where 'embed.weight' still lacks"),
        ([("embed.weight", embed), ("embed.weight", embed[:1]), *rest], "where the layout has"),
        ([("embed.weight", embed[:299]), ("embed.weight", embed[:2]), *rest], "rows beyond"),
        ([("embed.weight", embed[:100, :32]), *rest], r"\[rows, 64\]"),
        ([("embed.weight", embed[:100].float()), *rest], "float32"),
        ([("embed.weight", embed[:100])], "0 tensors for a layout of 4"),
    ):
        with pytest.raises(LayoutMismatch, match=problem):
            WeightEncoder(bucket_bytes=1000).encode_buckets(4, layout, iter(pieces), KeepingSink())


def test_an_encoder_with_deltas_does_not_stream() -> None:
    """A delta is computed against the whole previous version, which a streamed version
    never holds: such an encoder refuses to stream instead of sending only full ones."""
    from seamlessflow.weights.layout import plan_layout

    state = model_state()
    encoder = WeightEncoder(bucket_bytes=1000, deltas=True)
    assert not encoder.streams and WeightEncoder(bucket_bytes=1000).streams
    with pytest.raises(ValueError, match="deltas"):
        encoder.encode_buckets(1, plan_layout(state), iter(state.items()), KeepingSink())
