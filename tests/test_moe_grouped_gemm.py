"""--moe-grouped-gemm (models.moe_grouped): an MoE layer's experts as one grouped product per
projection over the tokens sorted by expert. The layer with it gives the outputs and gradients
of the layer without it (SequentialMLP's loop); the grouped product agrees with a float64 loop
of per-expert products, and that comparison catches rows given to the neighbouring expert and a
transposed weight slice; the parameters, their names and state dict are the same either way,
and a checkpoint saved with the flag resumes without it and the other way round, in megart's
format and Megatron's legacy and torch_dist ones (test_moe_grouped_ckpt: the files); megart train
with the flag follows the curve without it in one process, under tp2 with sequence parallelism,
under ep2 and ep2 with the distributed optimizer."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import train_workers as tw
from megart.launcher import launch
from megart.models.config import GPTConfig
from megart.models.moe import AuxLossScale, MoE
from megart.models.moe_grouped import grouped_linear, native, pack, stacked

ACTIVATIONS = ("gelu", "swiglu", "squared_relu")


def layer(experts: int, k: int, activation: str, grouped: bool, h: int = 16) -> MoE:
    cfg = GPTConfig(
        vocab_size=64, seq_length=8, hidden_size=h, num_layers=2, num_attention_heads=2,
        num_experts=experts, moe_router_topk=k, moe_router_pre_softmax=k == 1, bias=False,
        activation=activation, moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.01,
    )  # fmt: skip
    moe = MoE(cfg, 0, AuxLossScale())
    if grouped:
        moe.group()
    return moe


def outputs_and_grads(moe: MoE, x: torch.Tensor, dtype: torch.dtype | None) -> dict:
    """The layer's output for ``x`` and the gradients of ``x`` and every parameter, by name
    (under bf16 autocast where ``dtype`` is bf16)."""
    x = x.detach().clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        y = moe(x)
    y.float().pow(2).sum().backward()
    grads = {n: p.grad for n, p in moe.named_parameters()}
    return {"out": y.detach(), "x": x.grad, **grads}


# float64: the same products in the same order; fp32 and bf16 within a few roundings.
TOLERANCE = {
    torch.float64: dict(rtol=1e-12, atol=1e-14),
    torch.float32: dict(rtol=1e-5, atol=1e-7),
    torch.bfloat16: dict(rtol=2e-2, atol=1e-4),
}


def assert_same_layer(experts: int, k: int, activation: str, tokens: int, dtype: torch.dtype):
    torch.manual_seed(tokens)
    x = torch.randn(tokens, 1, 16)
    weights = torch.float64 if dtype == torch.float64 else torch.float32
    got = outputs_and_grads(layer(experts, k, activation, True).to(weights), x.to(weights), dtype)
    want = outputs_and_grads(layer(experts, k, activation, False).to(weights), x.to(weights), dtype)
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], **TOLERANCE[dtype], msg=name)
    return want


@settings(max_examples=12, deadline=None)
@given(
    experts=st.integers(2, 6),
    k=st.integers(1, 3),
    activation=st.sampled_from(ACTIVATIONS),
    tokens=st.integers(1, 12),
    dtype=st.sampled_from((torch.float64, torch.float32, torch.bfloat16)),
)
def test_the_layer_with_the_flag_is_the_layer_without(experts, k, activation, tokens, dtype):
    assert_same_layer(experts, min(k, experts), activation, tokens, dtype)


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_experts_with_no_tokens_get_zero_gradients_either_way(activation):
    """One token, top-2 of 6: four experts get no rows and a zero gradient (as SequentialMLP
    runs every expert)."""
    want = assert_same_layer(6, 2, activation, 1, torch.float64)
    zero = [n for n, g in want.items() if n.startswith("experts.") and not g.any()]
    assert len(zero) == 4 * (3 if activation == "swiglu" else 2)


def loop_reference(x: torch.Tensor, counts: list[int], weights: list[torch.Tensor]) -> dict:
    """Each group's rows times its weight's transpose, in float64, one product per expert, and
    the gradients of sum(y^2) with respect to x and each weight."""
    x = x.detach().double().requires_grad_()
    ws = [w.detach().double().requires_grad_() for w in weights]
    y = torch.cat([rows @ w.t() for rows, w in zip(x.split(counts), ws, strict=True)])
    y.pow(2).sum().backward()
    return {"y": y.detach(), "x": x.grad, **{f"w{e}": w.grad for e, w in enumerate(ws)}}


def grouped(x: torch.Tensor, counts: list[int], weights: list[torch.Tensor]) -> dict:
    x = x.detach().clone().requires_grad_()
    ws = [w.detach().clone().requires_grad_() for w in weights]
    y = grouped_linear(x, counts, ws)
    y.double().pow(2).sum().backward()
    return {"y": y.detach(), "x": x.grad, **{f"w{e}": w.grad for e, w in enumerate(ws)}}


def differs(got: dict, want: dict) -> float:
    """The largest difference of any of ``got`` from ``want``, relative to want's largest."""
    return max(float((got[k].double() - v).abs().max() / v.abs().max()) for k, v in want.items())


COUNTS = [3, 0, 5, 1, 7]  # an expert with no rows among them


def operands(dtype: torch.dtype, width: int = 16, square: bool = False):
    torch.manual_seed(0)
    x = torch.randn(sum(COUNTS), width, dtype=dtype)
    out = width if square else 24
    weights = [torch.randn(out, width, dtype=dtype) for _ in COUNTS]
    return x, weights


@pytest.mark.parametrize(
    "dtype,width,is_native,tolerance",
    [
        (torch.float64, 16, False, 1e-14),  # torch._grouped_mm refuses float64: the loop
        (torch.float32, 16, True, 1e-6),  # torch._grouped_mm
        (torch.float32, 6, False, 1e-6),  # rows of 24 bytes: not 16-byte aligned, the loop
        (torch.bfloat16, 16, True, 2e-2),
    ],
)
def test_the_grouped_product_is_a_loop_of_per_expert_products(dtype, width, is_native, tolerance):
    x, weights = operands(dtype, width)
    assert native(x, stacked(weights).transpose(1, 2)) == is_native
    assert differs(grouped(x, COUNTS, weights), loop_reference(x, COUNTS, weights)) < tolerance


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_the_comparison_catches_rows_of_the_neighbouring_expert_and_a_transposed_slice(dtype):
    x, weights = operands(dtype, square=True)
    want = loop_reference(x, COUNTS, weights)
    assert differs(grouped(x, COUNTS, weights), want) < 1e-6
    shifted = [COUNTS[0] - 1, COUNTS[1] + 1, *COUNTS[2:]]  # expert 0's last row to expert 1
    assert differs(grouped(x, shifted, weights), want) > 0.1
    transposed = [weights[0].t().contiguous(), *weights[1:]]
    assert differs(grouped(x, COUNTS, transposed), want) > 0.1


def test_packed_weights_are_read_without_a_copy_and_copied_once_moved_apart():
    moe = layer(4, 2, "swiglu", grouped=True)
    for name in ("fc", "gate", "proj"):
        params = [getattr(m, name).weight for m in moe.experts]
        view = stacked(params)
        assert view.data_ptr() == params[0].data_ptr()
        assert all(torch.equal(view[e], p) for e, p in enumerate(params))
    params = [m.fc.weight for m in moe.experts]
    params[2].data = params[2].data.clone()  # as --half-weights' casts leave them
    copy = stacked(params)
    assert copy.data_ptr() != params[0].data_ptr()
    assert all(torch.equal(copy[e], p) for e, p in enumerate(params))


def test_the_state_dict_is_the_same_and_loads_both_ways():
    plain, packed = layer(4, 2, "swiglu", False), layer(4, 2, "swiglu", True)
    a, b = plain.state_dict(), packed.state_dict()
    assert list(a) == list(b) and all(torch.equal(a[n], b[n]) for n in a)
    assert [n for n, _ in plain.named_parameters()] == [n for n, _ in packed.named_parameters()]
    torch.manual_seed(1)
    other = {n: torch.randn_like(t) for n, t in a.items()}
    packed.load_state_dict(other)
    plain.load_state_dict(packed.state_dict())
    assert all(torch.equal(plain.state_dict()[n], other[n]) for n in other)
    fc = [m.fc.weight for m in packed.experts]
    assert stacked(fc).data_ptr() == fc[0].data_ptr()  # loaded in place: still packed
    x = torch.randn(6, 1, 16)
    torch.testing.assert_close(outputs_and_grads(packed, x, None)["out"],
                               outputs_and_grads(plain, x, None)["out"])  # fmt: skip


def test_pack_keeps_the_parameters_and_their_attributes():
    moe = layer(4, 2, "gelu", grouped=False)
    before = {n: (p, p.detach().clone()) for n, p in moe.named_parameters()}
    for p in moe.experts.parameters():
        p.expert_parallel = True
    pack(list(moe.experts))
    for n, p in moe.named_parameters():
        assert p is before[n][0] and torch.equal(p, before[n][1]), n
    assert all(p.expert_parallel for p in moe.experts.parameters())
    assert all(p.partition_dim == 0 for p in (m.fc.weight for m in moe.experts))


MODEL = dict(num_experts=4, disable_bias_linear=True, moe_aux_loss_coeff=0.1,
             moe_z_loss_coeff=0.01, train_iters=4)  # fmt: skip
RUNS = {
    "one-process": (1, {}),
    "tp2-sp": (2, dict(tensor_model_parallel_size=2, sequence_parallel=True)),
    "ep2": (2, dict(expert_model_parallel_size=2)),
    "ep2-distopt": (2, dict(expert_model_parallel_size=2, use_distributed_optimizer=True)),
}


@pytest.mark.parametrize("name", RUNS)
def test_megart_train_with_the_flag_follows_the_curve_without_it(name):
    n, flags = RUNS[name]
    without = launch(tw.train_kw, n, dict(MODEL, **flags), timeout=300)[0]
    with_it = launch(tw.train_kw, n, dict(MODEL, moe_grouped_gemm=True, **flags), timeout=300)[0]
    for key in ("loss", "grad_norm", "load_balancing_loss", "z_loss"):
        want = [h[key] for h in without]
        assert [h[key] for h in with_it] == pytest.approx(want, rel=1e-6, abs=0), key


@pytest.mark.parametrize("fmt", ["megart", "torch", "torch_dist"])
@pytest.mark.parametrize("saved_with", [True, False])
def test_a_checkpoint_resumes_on_the_curve_with_the_flag_turned(tmp_path, saved_with, fmt):
    """In each format (Megatron's too: the flag writes SequentialMLP's files), holding
    exactly the weights and moments saved."""
    save, run = (
        dict(MODEL, moe_grouped_gemm=saved_with, ckpt_format=fmt),
        dict(MODEL, moe_grouped_gemm=not saved_with, ckpt_format=fmt),
    )
    trained, resumed = tw.saved_and_resumed(1, save, 1, run, tmp_path / "ckpt")
    tw.assert_holds(trained, resumed)
    straight = launch(tw.train_kw, 1, run, timeout=300)[0]
    tw.assert_resumed_on_curve(straight, resumed, rel=1e-6, abs=0)
