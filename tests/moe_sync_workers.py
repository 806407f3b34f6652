"""Workers of test_moe_host_syncs: the operations of one MoE forward that make a GPU wait for
the host, counted."""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# aten operations whose result the host must read before it can go on: nonzero (its length)
# and a tensor's scalar read (item, int(t)). Tensor.tolist copies without dispatching, so it is
# not counted here.
WAITS = ("aten.nonzero.default", "aten._local_scalar_dense.default")


class _Counting(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.seen: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        if str(func) in WAITS:
            self.seen[str(func)] += 1
        return func(*args, **(kwargs or {}))


def waits_of_one_forward(kw: dict) -> dict:
    """The host waits of one training forward of a one-layer MoE model built from GPTConfig
    fields ``kw``, on this rank (under expert parallelism when launched on more ranks with
    ``expert_model_parallel_size``)."""
    import megart.distributed as dist
    from megart.models import GPT, GPTConfig

    ep = kw.pop("expert_model_parallel_size", 1)
    cfg = GPTConfig(**kw)
    grid = None
    if ep > 1:
        import megart

        grid = megart.initialize(tp=1, pp=1, ep=ep, num_experts=cfg.num_experts)
    model = GPT(cfg, grid=grid) if grid is not None else GPT(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length), generator=torch.Generator())
    model.train()
    with _Counting() as counting:
        model(tokens, tokens)
    if ep > 1:
        dist.barrier()
    return dict(counting.seen)
