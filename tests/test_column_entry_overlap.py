"""The backward collective of a column-parallel entry runs while the weight gradients of the
products reading it are computed (megart.tensor_parallel.column_entry): on real tp2 ranks the
entry starts its all-reduce (or, with sequence parallelism, its reduce-scatter) before any of
those products' dW, and waits for it after all of them; SwiGLU's gate and up share one entry,
so both dWs run inside its one collective. The gradients are one process's in float64, with
gradient accumulation fusion and without."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megart.launcher import launch


def _mlp_events(sequence_parallel: bool, activation: str, fuse: bool) -> dict:
    import megart.distributed as dist
    from megart.models.config import GPTConfig
    from megart.models.mlp import MLP
    from megart.tensor_parallel import column_entry, weight_grad

    dist.init(timeout=60)
    cfg = GPTConfig(hidden_size=16, num_attention_heads=2, num_layers=1, activation=activation,
                    ffn_hidden_size=32, bias=True)  # fmt: skip
    tp = dist.new_group([0, 1])
    rank = dist.get_rank()
    ours, whole = MLP(cfg, 0, tp, sequence_parallel).double(), MLP(cfg, 0, None, False).double()
    x = torch.randn(8, 2, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    mine = (x.chunk(2)[rank] if sequence_parallel else x).clone().requires_grad_()
    if fuse:  # gradients the fused products add into, as megart train's buffers are
        for p in ours.parameters():
            p.grad = torch.zeros_like(p)
    events: list[str] = []

    class LoggedWork:
        def __init__(self, work: object) -> None:
            self.work = work

        def wait(self) -> None:
            self.work.wait()
            events.append("wait")

    def starting(start):  # noqa: ANN001, ANN202
        def call(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            out, work = start(*args, **kwargs)
            events.append("start")
            return out, LoggedWork(work)

        return call

    def accumulating(kept, run_hooks=True):  # noqa: ANN001, ANN202
        events.extend("dW" for _ in kept)
        return original(kept, run_hooks)

    original = weight_grad.accumulate
    patches = [(column_entry, "start_all_reduce"), (column_entry, "start_reduce_scatter")]
    saved = {(m, n): getattr(m, n) for m, n in patches}
    for module, name in patches:
        setattr(module, name, starting(getattr(module, name)))
    column_entry.accumulate = weight_grad.accumulate = accumulating
    try:
        with weight_grad.fusing_accumulation(fuse):
            y = ours(mine)
            y.sum().backward()
    finally:
        for (module, name), fn in saved.items():
            setattr(module, name, fn)
        column_entry.accumulate = weight_grad.accumulate = original
    xw = x.clone().requires_grad_()
    whole(xw).sum().backward()
    errors = {"dx": (mine.grad - (xw.grad.chunk(2)[rank] if sequence_parallel else xw.grad))}
    for (name, p), (_, q) in zip(ours.named_parameters(), whole.named_parameters(), strict=True):
        dim = getattr(p, "partition_dim", None)
        want = q.grad if dim is None else q.grad.chunk(2, dim)[rank]
        if getattr(p, "sequence_parallel", False):  # a partial sum until synced
            summed = p.grad.clone()
            dist.all_reduce(summed, group=tp)
            errors[name] = summed - want
        else:
            errors[name] = p.grad - want
    dist.destroy()
    return dict(events=events, errors={k: v.abs().max().item() for k, v in errors.items()})


@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "unfused"])
@pytest.mark.parametrize("activation, products", [("swiglu", 2), ("gelu", 1)])
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "sp"])
def test_the_entrys_collective_is_in_flight_while_its_products_dw_run(
    sequence_parallel, activation, products, fuse
):
    for rank in launch(_mlp_events, 2, sequence_parallel, activation, fuse, timeout=120):
        # The row-parallel product's dW runs in its own backward, before the entry's (fused:
        # by weight_grad.accumulate; unfused, by autograd, unlogged); then the entry: its
        # collective started, the column products' dWs, the wait.
        row = ["dW"] if fuse else []
        assert rank["events"] == row + ["start"] + ["dW"] * products + ["wait"], rank
        assert max(rank["errors"].values()) < 1e-12, rank["errors"]


MODEL = dict(num_layers=4, hidden_size=1024, num_attention_heads=16, seq_length=1024,
             vocab_size=32000, global_batch_size=8, bf16=True)  # fmt: skip


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "sp"])
def test_megart_plan_hides_these_collectives_except_under_zero_bubble(sp):
    """megart's runtime: the entries' backward collectives beside the weight gradients (no
    re-gather: megart keeps the gathered input), none under zb-h1, whose I leaves them to W."""
    from megart.errors import ConfigError
    from megart.plan import Layout, estimate, load_profile
    from megart.plan.collectives import KEPT_INPUT_OVERLAP
    from megart.plan.timing import layer_work
    from megart.training.config import TrainConfig

    gpu = load_profile("h100-80gb")
    base = TrainConfig(**MODEL)
    cfg = base.gpt_config()
    layer = dict(b=1, tp=2, sp=sp, recompute=None, gpu=gpu)
    hidden = layer_work(cfg, tp_overlap=KEPT_INPUT_OVERLAP, **layer)
    plain = layer_work(cfg, tp_overlap=False, **layer)
    assert hidden.forward == plain.forward and hidden.tp_comm < plain.tp_comm
    free = dict(layer, gpu=dataclasses.replace(gpu, peak_tflops=1e12))  # products take no time
    kept = layer_work(cfg, tp_overlap=KEPT_INPUT_OVERLAP, **free)
    assert kept.backward == pytest.approx(layer_work(cfg, tp_overlap=False, **free).backward)
    one_f_one_b = estimate(base, Layout(2, 2, 1, 1, 1, sp, None, False), gpu)
    zero_bubble = estimate(base, Layout(2, 2, 1, 1, 1, sp, None, False, "zb-h1"), gpu)
    layers = 2  # per stage
    assert one_f_one_b.stage.tp_comm == pytest.approx(layers * hidden.tp_comm, rel=1e-12)
    assert zero_bubble.stage.tp_comm == pytest.approx(layers * plain.tp_comm, rel=1e-12)
    with pytest.raises(ConfigError, match="tp_overlap True describes --runtime megatron"):
        estimate(base, Layout(2, 1, 1, 1, 1, sp, None, False), gpu, tp_overlap=True)
