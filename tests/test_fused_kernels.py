"""The fused ops (megart.kernels) on the CPU, where their torch references run: forward and
autograd backward against float64 torch (F.gelu, F.layer_norm, F.cross_entropy and the unfused
vocab-parallel cross-entropy), odd shapes by hypothesis, 16-bit inputs, the GPT wiring behind
the fusion flags, and vocab-parallel cross-entropy at t = 2 through real processes.
The CUDA kernels' tests are in test_fused_kernels_cuda.py."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import gpt_workers as gw
import megart.tensor_parallel as tp
import tp_workers as tw
from megart import ConfigError
from megart.kernels import add_layer_norm, bias_gelu, fused_vocab_parallel_cross_entropy, layer_norm
from megart.kernels._dispatch import cuda_kernel
from megart.launcher import launch
from megart.models import GPT, GPTConfig
from megart.training.config import TrainConfig

F64 = torch.float64
EXACT = {"rtol": 1e-12, "atol": 1e-12}

# Leading shapes with 1 and odd sizes; hidden sizes around multiples of 8 (a 16-byte pack).
leading = st.lists(st.integers(1, 5), min_size=1, max_size=3)
hidden = st.sampled_from([1, 2, 3, 7, 8, 9, 15, 33, 64, 100])


def randn(gen, *shape, dtype=F64):
    return torch.randn(*shape, generator=gen, dtype=F64).to(dtype)


def leaves(*tensors):
    return [None if t is None else t.detach().clone().requires_grad_() for t in tensors]


def rel(actual, expected):
    return ((actual.double() - expected.double()).norm() / expected.double().norm()).item()


# --- bias + GeLU ------------------------------------------------------------------------------


@settings(max_examples=25, deadline=None)
@given(leading, hidden, st.integers(0, 2**31 - 1))
def test_bias_gelu_and_its_backward_equal_torch_in_float64(lead, h, seed):
    gen = torch.Generator().manual_seed(seed)
    x, bias, g = randn(gen, *lead, h) * 3, randn(gen, h), randn(gen, *lead, h)
    a, b = leaves(x, bias)
    out = bias_gelu(a, b)
    (out * g).sum().backward()
    ra, rb = leaves(x, bias)
    ref = F.gelu(ra + rb, approximate="tanh")
    (ref * g).sum().backward()
    torch.testing.assert_close(out, ref, **EXACT)
    torch.testing.assert_close(a.grad, ra.grad, **EXACT)
    torch.testing.assert_close(b.grad, rb.grad, **EXACT)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_bias_gelu_in_lower_precision_is_close_to_float64(dtype, tol):
    gen = torch.Generator().manual_seed(1)
    x, bias, g = randn(gen, 6, 40, dtype=dtype), randn(gen, 40, dtype=dtype), randn(gen, 6, 40)
    a, b = leaves(x, bias)
    out = bias_gelu(a, b)
    (out.double() * g).sum().backward()
    assert out.dtype == dtype and a.grad.dtype == dtype and b.grad.dtype == dtype
    ra, rb = leaves(x.double(), bias.double())
    ref = F.gelu(ra + rb, approximate="tanh")
    (ref * g).sum().backward()
    assert rel(out, ref) < tol and rel(a.grad, ra.grad) < tol and rel(b.grad, rb.grad) < tol


# --- LayerNorm with the residual add ----------------------------------------------------------


@settings(max_examples=25, deadline=None)
@given(leading, hidden, st.booleans(), st.booleans(), st.integers(0, 2**31 - 1))
def test_add_layer_norm_and_its_backward_equal_torch_in_float64(lead, h, residual, bias, seed):
    gen = torch.Generator().manual_seed(seed)
    shape = (*lead, h)
    x, r = randn(gen, *shape) * 2 + 1, randn(gen, *shape) if residual else None
    w, b = randn(gen, h), randn(gen, h) if bias else None
    g_out, g_sum = randn(gen, *shape), randn(gen, *shape)
    ins = leaves(x, r, w, b)
    refs = leaves(x, r, w, b)
    s_ref = refs[0] if r is None else refs[0] + refs[1]
    out_ref = F.layer_norm(s_ref, (h,), refs[2], refs[3], 1e-5)
    if r is None:
        out = layer_norm(ins[0], ins[2], ins[3], 1e-5)
        objective, ref_objective = (out * g_out).sum(), (out_ref * g_out).sum()
    else:
        out, s = add_layer_norm(*ins, 1e-5)
        torch.testing.assert_close(s, s_ref, **EXACT)
        objective = (out * g_out).sum() + (s * g_sum).sum()
        ref_objective = (out_ref * g_out).sum() + (s_ref * g_sum).sum()
    torch.testing.assert_close(out, out_ref, **EXACT)
    objective.backward()
    ref_objective.backward()
    for mine, ref, name in zip(ins, refs, ("x", "residual", "weight", "bias"), strict=True):
        if mine is not None:
            torch.testing.assert_close(mine.grad, ref.grad, rtol=1e-10, atol=1e-10, msg=name)


def test_add_layer_norm_with_an_unused_sum_and_in_bfloat16():
    gen = torch.Generator().manual_seed(2)
    x, r = randn(gen, 5, 24, dtype=torch.bfloat16), randn(gen, 5, 24, dtype=torch.bfloat16)
    w, b = randn(gen, 24, dtype=torch.bfloat16), randn(gen, 24, dtype=torch.bfloat16)
    ins = leaves(x, r, w, b)
    out, s = add_layer_norm(*ins, 1e-5)
    assert out.dtype == s.dtype == torch.bfloat16
    out.double().sum().backward()  # the sum gets no gradient: None reaches the backward
    refs = leaves(*(t.double() for t in (x, r, w, b)))
    F.layer_norm((refs[0] + refs[1]).bfloat16().double(), (24,), refs[2], refs[3]).sum().backward()
    for mine, ref in zip(ins, refs, strict=True):
        assert mine.grad.dtype == torch.bfloat16 and rel(mine.grad, ref.grad) < 1e-2


def test_layer_norm_promotes_mixed_dtypes_as_autocast_leaves_them():
    # Under autocast a bf16 branch meets the fp32 residual stream and fp32 weights: fp32.
    x, r = torch.randn(3, 8).bfloat16(), torch.randn(3, 8)
    out, s = add_layer_norm(x, r, torch.ones(8), torch.zeros(8), 1e-5)
    assert out.dtype == s.dtype == torch.float32
    torch.testing.assert_close(s, x.float() + r, rtol=0, atol=0)


# --- vocab-parallel cross-entropy ---------------------------------------------------------------


@settings(max_examples=25, deadline=None)
@given(leading, st.integers(1, 70), st.sampled_from([1.0, 30.0, 1000.0]), st.integers(0, 2**31 - 1))
def test_fused_cross_entropy_equals_torch_in_float64(lead, vocab, scale, seed):
    gen = torch.Generator().manual_seed(seed)
    logits = randn(gen, *lead, vocab) * scale
    target = torch.randint(0, vocab, tuple(lead), generator=gen)
    target.view(-1)[0] = -100
    g = randn(gen, *lead)
    (a,) = leaves(logits)
    loss = fused_vocab_parallel_cross_entropy(a, target, None)
    (ref_logits,) = leaves(logits)
    ref = F.cross_entropy(ref_logits.reshape(-1, vocab), target.reshape(-1), reduction="none").view(
        target.shape
    )
    torch.testing.assert_close(loss, ref, **EXACT)
    (loss * g).sum().backward()
    (ref * g).sum().backward()
    torch.testing.assert_close(a.grad, ref_logits.grad, **EXACT)
    torch.testing.assert_close(a, logits, rtol=0, atol=0)  # a leaf is never overwritten


def test_fused_cross_entropy_is_bitwise_the_unfused_op_in_float32_with_padding():
    gen = torch.Generator().manual_seed(3)
    logits = randn(gen, 4, 3, 64, dtype=torch.float32) * 5
    logits[..., 50:] = float("-inf")  # padded vocabulary ids, as GPT masks them
    target = torch.randint(0, 50, (4, 3), generator=gen)
    target[1, 2] = -100
    base = torch.zeros_like(logits, requires_grad=True)
    ref = tp.vocab_parallel_cross_entropy(base + logits, target, None)
    loss = fused_vocab_parallel_cross_entropy(base + logits, target, None)  # overwritten: ours
    assert torch.equal(loss, ref)
    (ref_grad,) = torch.autograd.grad(ref.sum(), base)
    (grad,) = torch.autograd.grad(loss.sum(), base)
    assert torch.equal(grad, ref_grad)


def test_fused_cross_entropy_keeps_16_bit_logits_and_backward_runs_once():
    logits = torch.randn(6, 16).bfloat16().requires_grad_()
    target = torch.tensor([0, 3, 15, -100, 7, 7])
    loss = fused_vocab_parallel_cross_entropy(logits, target, None)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, F.cross_entropy(logits.float(), target, reduction="none"))
    loss.sum().backward(retain_graph=True)
    assert logits.grad.dtype == torch.bfloat16 and logits.grad[3].abs().sum() == 0
    with pytest.raises(ConfigError, match="second time"):
        loss.sum().backward()


def test_fused_cross_entropy_at_tensor_parallel_2_with_an_all_padding_slice():
    cases = [(3, 8, 1, 1.0, 1, True), (5, 12, 0, 30.0, 2, False), (1, 4, 0, 1000.0, 3, True)]
    assert launch(tw.cross_entropy, 2, cases, True, timeout=180) == [3 * len(cases)] * 2


# --- checks, dispatch, and the GPT wiring -------------------------------------------------------


def test_bad_shapes_and_dtypes_raise_config_errors_that_say_what_to_change():
    with pytest.raises(ConfigError, match="last dimension"):
        bias_gelu(torch.zeros(2, 3), torch.zeros(4))
    with pytest.raises(ConfigError, match="must both be"):
        layer_norm(torch.zeros(2, 3), torch.ones(4), None, 1e-5)
    with pytest.raises(ConfigError, match="residual"):
        add_layer_norm(torch.zeros(2, 3), torch.zeros(3, 3), torch.ones(3), None, 1e-5)
    with pytest.raises(ConfigError, match="eps"):
        layer_norm(torch.zeros(2, 3), torch.ones(3), None, 0.0)
    with pytest.raises(ConfigError, match="without its last"):
        fused_vocab_parallel_cross_entropy(
            torch.zeros(2, 5), torch.zeros(3, dtype=torch.long), None
        )
    with pytest.raises(ConfigError, match="integers"):
        fused_vocab_parallel_cross_entropy(torch.zeros(2, 5), torch.zeros(2), None)
    with pytest.raises(ConfigError, match="activation='gelu'"):
        GPTConfig(activation="swiglu", bias_gelu_fusion=True)
    with pytest.raises(ConfigError, match="fused_layer_norm"):
        GPTConfig(normalization="rmsnorm", fused_layer_norm=True)


def test_cpu_tensors_use_the_torch_reference():
    assert cuda_kernel("bias_gelu_forward", torch.zeros(3)) is None


def test_fusion_flags_are_train_flags_and_only_bias_gelu_is_on_by_default():
    """--bias-gelu-fusion is on in megart train's default run, as in Megatron-LM; the other
    two are off; GPTConfig, the library's model config, turns none on by itself."""
    from megart.cli.train import add_arguments, config_from_args

    names = ("bias_gelu_fusion", "fused_layer_norm", "cross_entropy_loss_fusion")
    assert not any(getattr(GPTConfig(), n) for n in names)
    default = TrainConfig().gpt_config()
    assert default.bias_gelu_fusion
    assert not default.fused_layer_norm and not default.cross_entropy_loss_fusion
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    argv = ["--bias-gelu-fusion", "--fused-layer-norm", "--cross-entropy-loss-fusion"]
    assert all(getattr(config_from_args(parser.parse_args(argv)), n) for n in names)


def test_a_small_gpt_gives_the_same_loss_with_the_fusion_flags_on_the_cpu():
    cfg = gw.small_config()
    x = gw.tokens()
    losses, grads = [], []
    for c in (cfg, dataclasses.replace(cfg, **gw.FUSION_FLAGS)):
        model = GPT(c)
        loss = model(x[:, :-1], x[:, 1:])
        loss.backward()
        losses.append(loss.item())
        grads.append({n: p.grad for n, p in model.named_parameters()})
    assert losses[0] == losses[1]  # the references run the unfused ops' forward exactly
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, rtol=1e-5, atol=1e-7, msg=name)


def test_a_gpt_with_the_fusion_flags_equals_one_process_at_tensor_parallel_4():
    # At t = 4 the last rank's vocabulary slice (ids 384..511 of 300 real) is all padding.
    reference = gw.loss_and_grads(None, False, {})
    for loss, grads in launch(gw.tp_run, 4, True, gw.FUSION_FLAGS, timeout=240):
        assert loss == pytest.approx(reference[0], rel=1e-5)
        for name, g in grads.items():
            torch.testing.assert_close(g, reference[1][name], rtol=1e-5, atol=1e-6, msg=name)
