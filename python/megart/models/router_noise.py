"""The MoE router's noise: --moe-input-jitter-eps (the router's input times uniform noise in
[1 - eps, 1 + eps], training only) and --moe-router-force-load-balancing (its logits replaced by
standard normal ones, Megatron-Core's benchmarking option: routing balanced by chance, the
model's math changed; the gradient passes straight through to the real logits, as Megatron-
Core's RandomSTE).

Megatron-Core draws both from the device's streams, so its noise depends on the layout (the
force option even seeds each expert-parallel rank apart). megart draws every token's noise from
a generator keyed by (the model seed, the layer, which noise, the batch, the sample's index in
the global batch): each sample's [s, width] noise over its whole sequence, of which a rank
keeps its tokens' rows (under sequence parallelism its slice, under context parallelism its
two chunks). The same token thus gets the same noise under every tensor-, sequence-, context-,
pipeline-, data- and expert-parallel layout and any microbatch size, so such runs follow the
one-process curve; the cost is that each rank draws its samples' whole sequences (t x cp times
its own tokens' noise). Nothing moves torch's random streams (dropout's masks are unchanged),
recomputation draws the same noise again (the engine names the microbatch before its forward
and before its backward, where recomputation runs), and a resumed run draws what the
uninterrupted one would (the key is the iteration's). The noise is drawn on the device of the
tokens: CPU and CUDA generators differ, as dropout's masks do.

The key (NoiseKey) is the chunk's, shared by its MoE layers: the trainer names the batch and
this rank's first sample before each iteration and evaluation batch, the pipeline engine the
microbatch (GPTChunk.set_microbatch).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import torch

from megart.distributed import ProcessGroup
from megart.models.context_parallel import group_positions
from megart.tensor_parallel._group import group_rank, group_size


class NoiseKey:
    """Which tokens a chunk's forward runs: ``batch`` (a tuple naming the global batch, e.g.
    ("train", iteration)), ``first_sample`` (this data-parallel rank's first sample in it) and
    ``microbatch`` (of this rank's, each ``b`` samples)."""

    def __init__(self) -> None:
        self.batch: tuple[object, ...] = ("train", 0)
        self.first_sample = 0
        self.microbatch = 0

    def start(self, batch: tuple[object, ...], first_sample: int) -> None:
        """The batch the next forwards run, this rank's share from sample ``first_sample``."""
        self.batch, self.first_sample, self.microbatch = batch, first_sample, 0

    def samples(self, b: int) -> range:
        """The global batch's indices of the current microbatch's ``b`` samples."""
        first = self.first_sample + self.microbatch * b
        return range(first, first + b)


def start_batch(chunks: list[Any], batch: tuple[object, ...], first_sample: int) -> None:
    """Names the batch ``chunks``' next forwards run (NoiseKey.start), where they have a key."""
    for chunk in chunks:
        scale = getattr(chunk, "aux_loss_scale", None)
        if scale is not None:
            scale.noise.start(batch, first_sample)


def _seed(*where: object) -> int:
    digest = hashlib.sha256(repr(where).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def token_noise(
    key: NoiseKey,
    where: tuple[object, ...],
    shape: tuple[int, int, int],
    groups: tuple[ProcessGroup | None, ProcessGroup | None],
    like: torch.Tensor,
    draw: Callable[[torch.Tensor, torch.Generator], Any],
) -> torch.Tensor:
    """[s, b, width] noise for this rank's ``shape`` tokens (s of each of b samples; under
    sequence parallelism over ``groups`` = (tp, cp) this rank's slice of its context-parallel
    part), in ``like``'s dtype and device: each sample's whole sequence drawn by ``draw`` from
    the generator of (``where``, its batch, its index), this rank's rows kept."""
    s, b, width = shape
    tp_group, cp_group = groups
    t, r = group_size(tp_group), group_rank(tp_group)
    # The global positions of this rank's rows: its cp part's, then its sequence slice of it.
    rows = group_positions(cp_group, s * t, like.device)[r * s : (r + 1) * s]
    whole = s * t * group_size(cp_group)
    out = []
    for sample in key.samples(b):
        g = torch.Generator(device=like.device).manual_seed(_seed(*where, key.batch, sample))
        full = torch.empty(whole, width, dtype=like.dtype, device=like.device)
        draw(full, g)
        out.append(full[rows])
    return torch.stack(out, dim=1)


def uniform(eps: float) -> Callable[[torch.Tensor, torch.Generator], Any]:
    """Draws uniform noise in [1 - eps, 1 + eps] (the jitter's)."""
    return lambda x, g: x.uniform_(1.0 - eps, 1.0 + eps, generator=g)


def normal(x: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """Standard normal noise (force_load_balancing's logits)."""
    return x.normal_(generator=g)


class StraightThrough(torch.autograd.Function):
    """``noise`` in forward; ``logits``' gradient is the output's (Megatron-Core's
    RandomSTE)."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        del ctx
        return noise.to(logits.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        del ctx
        return grad, None
