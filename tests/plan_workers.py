"""What a real megart train rank holds, for the planner's memory tests: bytes of parameters,
gradients and optimizer state after one iteration, and the peak bytes autograd's saved tensors
hold during the next one (torch's saved-tensor hooks)."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator

import numpy as np
import torch

from megart.training.config import TrainConfig
from megart.training.data import builtin_corpus


def plan_json(argv: str, capsys: object) -> dict:
    """What ``megart plan ARGV --json`` prints, parsed (``capsys``: pytest's fixture)."""
    import json

    from megart.cli.plan import main as plan_main

    assert plan_main((argv + " --json").split()) == 0
    return json.loads(capsys.readouterr().out)


def storage_key(t: torch.Tensor) -> int:
    """One storage's identity, whatever its size: --recompute-modules layernorm frees a saved
    storage in place (resized to 0 bytes, megart.models.dropped_output), whose address the
    allocator may then give another."""
    return t.untyped_storage()._cdata


class SavedBytes:
    """Bytes of the distinct storages that autograd's saved tensors hold, and their peak.
    Parameters (saved by every linear layer) are not activations and are left out, nor are
    autocast's 16-bit copies of the weights (the planner counts those apart): recognised as
    16-bit tensors shaped as a weight or its transpose, so the tests pick sizes where no
    activation has such a shape. A storage counts its size when the count is taken (at each
    save and each read): one freed in place after it was saved counts 0 until it is refilled,
    before backward reads it (--recompute-modules layernorm, megart.models.dropped_output)."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.params = {storage_key(p) for p in params}
        self.weight_shapes = {s for p in params if p.dim() == 2 for s in (p.shape, p.shape[::-1])}
        # storage -> [saved tensors holding it, the storage]
        self.live: dict[int, list] = {}
        self.peak = 0

    @property
    def now(self) -> int:
        """The bytes held now, each storage at its present size."""
        return sum(entry[1].nbytes() for entry in self.live.values())

    def pack(self, t: torch.Tensor) -> object:
        key = storage_key(t)
        if key in self.params:
            return t
        if t.dtype in (torch.bfloat16, torch.float16) and t.shape in self.weight_shapes:
            return t
        self._add(t, key)
        return _Held(t, key, self)

    def _add(self, t: torch.Tensor, key: int) -> None:
        entry = self.live.setdefault(key, [0, t.untyped_storage()])
        entry[0] += 1
        self.peak = max(self.peak, self.now)

    def hold(self, t: torch.Tensor) -> None:
        """Counts ``t``'s storage as held until ``t`` itself is collected (a tensor kept
        otherwise than as a saved tensor)."""
        key = storage_key(t)
        self._add(t, key)
        weakref.finalize(t, self.release, key)

    def unpack(self, held: object) -> torch.Tensor:
        if not isinstance(held, _Held):
            return held
        # A storage freed after it was saved grows back before backward reads it: counted when
        # read (between saves, only a refill can raise the count).
        self.peak = max(self.peak, self.now)
        return held.tensor

    def release(self, key: int) -> None:
        entry = self.live[key]
        entry[0] -= 1
        if entry[0] == 0:
            del self.live[key]

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


class _Held:
    """A saved tensor; when autograd drops it, its storage is no longer held on its behalf."""

    def __init__(self, tensor: torch.Tensor, ptr: int, meter: SavedBytes) -> None:
        self.tensor, self.ptr, self.meter = tensor, ptr, meter

    def __del__(self) -> None:
        self.meter.release(self.ptr)


class RecomputedBytes:
    """While active, each full-recomputation replay (torch's non-reentrant checkpoint, which
    saves the replayed span's tensors under its own hooks, unseen by ``meter``) is measured
    when it ends, before backward uses any: the distinct storages it saved that ``meter`` does
    not already hold (the span's input is one), parameters and autocast's weight copies left
    out as SavedBytes leaves them. ``peak``: the most ``meter`` held plus one replay's saves,
    over the replays (all the replayed saves are alive then: backward frees each as it uses
    it)."""

    def __init__(self, meter: SavedBytes) -> None:
        self.meter, self.peak = meter, 0

    def __enter__(self) -> RecomputedBytes:
        import torch.utils.checkpoint as ckpt

        self.hook = ckpt._recomputation_hook
        outer = self

        class Counted(self.hook):
            def __init__(self, *args: object) -> None:
                super().__init__(*args)
                self.seen: dict[int, int] = {}
                pack = self.pack_hook

                def counted(x: torch.Tensor) -> object:
                    outer.note(self.seen, x)
                    return pack(x)

                self.pack_hook = counted

            def __exit__(self, *exc: object) -> None:
                held = outer.meter.now + sum(self.seen.values())
                outer.peak = max(outer.peak, held)
                return super().__exit__(*exc)

        ckpt._recomputation_hook = Counted
        return self

    def __exit__(self, *exc: object) -> None:
        import torch.utils.checkpoint as ckpt

        ckpt._recomputation_hook = self.hook

    def note(self, seen: dict[int, int], t: torch.Tensor) -> None:
        m = self.meter
        key = storage_key(t)
        if key in m.params or key in m.live:
            return
        if t.dtype in (torch.bfloat16, torch.float16) and t.shape in m.weight_shapes:
            return
        seen[key] = t.untyped_storage().nbytes()


def _nbytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@contextlib.contextmanager
def _rope_held(meter: SavedBytes) -> Iterator[None]:
    """Counts rope's cos and sin tables as held for as long as they live: a chunk's layers
    save them (one storage), and under full recomputation the checkpoints' closures keep them
    to replay, which saved-tensor hooks do not see."""
    from megart.models.gpt import GPTChunk

    blocks = GPTChunk._blocks

    def counted(self: object, x: torch.Tensor, rope: tuple | None, *args: object) -> object:
        for table in rope or ():
            meter.hold(table)
        return blocks(self, x, rope, *args)

    GPTChunk._blocks = counted
    try:
        yield
    finally:
        GPTChunk._blocks = blocks


@contextlib.contextmanager
def _masks_held(meter: SavedBytes) -> Iterator[None]:
    """Counts --reset-attention-mask's boolean masks and their biases as held for as long as
    they live: models.window_masks.as_bias keeps the last mask and bias it was given, and
    recomputation's checkpoints keep the masks (their inputs) to replay, which saved-tensor
    hooks do not see."""
    import megart.models.window as window

    as_bias = window.as_bias

    def counted(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        bias = as_bias(mask, dtype)
        if mask.dtype == torch.bool:
            meter.hold(mask)
            meter.hold(bias)
        return bias

    window.as_bias = counted
    try:
        yield
    finally:
        window.as_bias = as_bias


@contextlib.contextmanager
def _windows_held(meter: SavedBytes) -> Iterator[None]:
    """Counts the sliding window's cached tensors as held (they live as long as the process:
    models.window_masks caches them): the additive bias that windowed layers' attention takes,
    one s x s or one query tile's band (models.window_tiles), and the boolean mask it was made
    from; the ring's pieces' biases (models.ring_window.piece_bias, whose masks are freed).
    Saved-tensor hooks see the bias only while some call saves it, and the mask never."""
    import megart.models.ring_window as ring_window
    import megart.models.window as window
    import megart.models.window_masks as masks
    import megart.models.window_tiles as tiles

    whole, band, piece = window.sliding_causal_bias, tiles.band_bias, ring_window.piece_bias
    seen: set[int] = set()

    def hold(*tensors: torch.Tensor) -> None:
        for t in tensors:
            if t.untyped_storage().data_ptr() not in seen:
                seen.add(t.untyped_storage().data_ptr())
                meter.hold(t)

    def whole_held(length: int, left: int, dtype: torch.dtype, device: object) -> torch.Tensor:
        bias = whole(length, left, dtype, device)
        hold(bias, masks.sliding_causal_mask(length, left, device))
        return bias

    def band_held(tile: int, left: int, dtype: torch.dtype, device: object) -> torch.Tensor:
        bias = band(tile, left, dtype, device)
        hold(bias, masks.band_mask(tile, left, device))
        return bias

    def piece_held(*args: object) -> torch.Tensor:
        bias = piece(*args)
        hold(bias)
        return bias

    window.sliding_causal_bias, tiles.band_bias = whole_held, band_held
    ring_window.piece_bias = piece_held
    try:
        yield
    finally:
        window.sliding_causal_bias, tiles.band_bias = whole, band
        ring_window.piece_bias = piece


def document_corpus(vocab: int, n: int = 1 << 16, seed: int = 0) -> np.ndarray:
    """Random tokens of NullTokenizer's ``vocab`` (--vocab-size) ids with its end-of-document
    id (``vocab``, the one after them) at about one token in eight."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab, n)
    tokens[rng.random(n) < 0.125] = vocab
    return tokens


def held_bytes(kw: dict, tokens: np.ndarray | None = None) -> dict:
    """``tokens``: the corpus (None: the built-in one)."""
    from megart.training.distributed_optimizer import DistributedOptimizer
    from megart.training.main_weights import MainWeights
    from megart.training.trainer import Trainer

    corpus = builtin_corpus(1 << 16) if tokens is None else tokens
    trainer = Trainer(TrainConfig(**kw), tokens=corpus)
    trainer.train_step(0)  # the optimizer state exists after the first step
    params = [p for chunk in trainer.chunks for p in chunk.parameters()]
    opt = trainer.optimizer
    mains: list[torch.Tensor] = []  # --half-weights: the fp32 main weights
    if isinstance(opt, DistributedOptimizer):
        param_bytes = _nbytes(opt.param_buffers)  # the parameters are views into these
        state = opt.optimizer.state
        mains = [m for m in opt.main_buffers if m is not None]
    elif isinstance(opt, MainWeights):
        param_bytes = _nbytes(params)
        state = opt.optimizer.state
        mains = opt.mains
    else:
        param_bytes = _nbytes(params)
        state = opt.state
    buckets = trainer.buckets.buckets
    # With --grad-reduce-in-bf16 each bucket also keeps the bf16 copy it reduces.
    copies = [b.reduced for b in buckets if b.reduced is not b.buffer]
    grad_bytes = _nbytes([b.buffer for b in buckets]) + _nbytes(copies)
    moments = [v for s in state.values() for v in s.values() if torch.is_tensor(v)]
    opt_bytes = _nbytes(moments) + _nbytes(mains)
    meter = SavedBytes(params)
    with (
        meter.hooks(),
        RecomputedBytes(meter) as replays,
        _rope_held(meter),
        _masks_held(meter),
        _windows_held(meter),
    ):
        trainer.train_step(1)
    g = trainer.grid
    return {
        "pp_rank": g.pp_rank,
        "dp_rank": g.dp_rank,
        "dp_cp_rank": g.dp_cp_rank,  # the distributed optimizer's shard index under cp
        "tp_rank": g.tp_rank,
        "parameters": param_bytes,
        "gradients": grad_bytes,
        "optimizer": opt_bytes,
        "saved_peak": meter.peak,
        "saved_after": meter.now,
        "recompute_peak": replays.peak,  # 0 without full recomputation
    }


def deferred_bytes(kw: dict) -> dict:
    """The peak bytes a zero-bubble rank keeps between its Is and Ws: the deferred linear
    layers' inputs and output gradients (megart.tensor_parallel.weight_grad), counted each
    time an I defers one, during the second iteration."""
    from megart.tensor_parallel.weight_grad import WeightGradStore
    from megart.training.trainer import Trainer

    trainer = Trainer(TrainConfig(**kw), tokens=builtin_corpus(1 << 16))
    trainer.train_step(0)
    peak = [0]
    defer = WeightGradStore.defer

    def measured(store: WeightGradStore, x: torch.Tensor, dy: torch.Tensor, params: tuple) -> bool:
        kept = defer(store, x, dy, params)
        tensors = {id(t): t for entry in store._pending.values() for k in entry for t in k[:2]}
        peak[0] = max(peak[0], _nbytes(list(tensors.values())))
        return kept

    WeightGradStore.defer = measured
    try:
        trainer.train_step(1)
    finally:
        WeightGradStore.defer = defer
    return {"pp_rank": trainer.grid.pp_rank, "tp_rank": trainer.grid.tp_rank, "peak": peak[0]}
