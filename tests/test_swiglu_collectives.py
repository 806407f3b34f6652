"""SwiGLU's gate and up projections are two column-parallel layers that read one input. They
share one entry into the tensor-parallel region (ColumnParallelLinear.enter), so an MLP layer
costs the collectives Megatron-Core's fused linear_fc1 costs (Korthikanti et al.: with sequence
parallelism one all-gather and one reduce-scatter each way; without, one all-reduce each way),
not one more per extra projection. Counted on real tp2 ranks, with the outputs and gradients
checked against one process in float64."""

import pytest
import torch

from megart.launcher import launch

OPS = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce")


def _mlp_collectives(sequence_parallel: bool) -> dict:
    import megart.distributed as dist
    from megart.models.blocks import MLP
    from megart.models.config import GPTConfig

    dist.init(timeout=60)
    cfg = GPTConfig(hidden_size=16, num_attention_heads=2, num_layers=1, activation="swiglu",
                    ffn_hidden_size=32, bias=False)  # fmt: skip
    tp = dist.new_group([0, 1])
    # Each layer draws its whole weight from the seed and keeps its slice: the same model.
    ours, whole = MLP(cfg, 0, tp, sequence_parallel).double(), MLP(cfg, 0, None, False).double()
    x = torch.randn(8, 2, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    mine = x.chunk(2)[dist.get_rank()] if sequence_parallel else x
    mine = mine.clone().requires_grad_()
    counts = dict.fromkeys(OPS, 0)
    originals = {op: getattr(dist, op) for op in OPS}

    def counting(op):
        def call(*args, **kwargs):
            counts[op] += 1
            return originals[op](*args, **kwargs)

        return call

    for op in OPS:
        setattr(dist, op, counting(op))
    forward = dict(counts)
    try:
        y = ours(mine)
        forward = dict(counts)
        y.sum().backward()
    finally:
        for op, fn in originals.items():
            setattr(dist, op, fn)
    backward = {op: counts[op] - forward[op] for op in OPS}
    x = x.clone().requires_grad_()
    want = whole(x)
    want.sum().backward()
    want_y = want.chunk(2)[dist.get_rank()] if sequence_parallel else want
    want_dx = x.grad.chunk(2)[dist.get_rank()] if sequence_parallel else x.grad
    dist.destroy()
    errors = dict(y=(y - want_y).abs().max().item(), dx=(mine.grad - want_dx).abs().max().item())
    return dict(forward=forward, backward=backward, **errors)


@pytest.mark.parametrize(
    "sequence_parallel, forward, backward",
    [
        (True, dict(all_gather_into_tensor=1, reduce_scatter_tensor=1, all_reduce=0),
         dict(all_gather_into_tensor=1, reduce_scatter_tensor=1, all_reduce=0)),
        (False, dict(all_gather_into_tensor=0, reduce_scatter_tensor=0, all_reduce=1),
         dict(all_gather_into_tensor=0, reduce_scatter_tensor=0, all_reduce=1)),
    ],
    ids=["sequence-parallel", "tensor-parallel"],
)  # fmt: skip
def test_an_mlp_layer_costs_megatrons_collectives(sequence_parallel, forward, backward):
    for rank in launch(_mlp_collectives, 2, sequence_parallel, timeout=120):
        assert rank["forward"] == forward and rank["backward"] == backward
        assert rank["y"] < 1e-12 and rank["dx"] < 1e-12
