"""megart's fused CUDA kernels against float64 torch references. They need a GPU and megart._cuda
and skip cleanly without them.

Each test draws fresh random inputs, fills every output buffer with NaN before the kernel runs
(so an element the kernel forgets shows), and compares ||out - ref|| / ||ref|| with a tolerance
per dtype. Shapes cover one element, odd sizes (no 16-byte packs), multiples of 8 (packs) and
base pointers one element past 16-byte alignment (a scalar head before the packs)."""

import pytest
import torch
import torch.nn.functional as F

import megart
from megart.kernels import add_layer_norm, bias_gelu, fused_vocab_parallel_cross_entropy
from megart.kernels._dispatch import KERNEL_DTYPES, cuda_kernel, launch
from megart.kernels.cross_entropy import cross_entropy_stats_reference

cuda_built = megart.build_info()["cuda_compiled"]
pytestmark = pytest.mark.skipif(
    not (cuda_built and torch.cuda.is_available()), reason="needs megart._cuda and a CUDA GPU"
)

F64 = torch.float64
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}
DTYPES = list(TOL)
SHAPES = [(1, 1), (7, 13), (5, 1000), (33, 1024), (4, 4104), (3, 8192), (1500, 520)]  # rows, cols
OFFSETS = [0, 1]  # elements past a 16-byte boundary


def kernels():
    from megart import _cuda

    return _cuda


def rand(shape, dtype, scale=1.0, offset=0):
    """Fresh normal values (the global CUDA generator, unseeded: new inputs every run); with an
    offset, in a buffer that starts `offset` elements into its allocation."""
    values = (torch.randn(shape, device="cuda", dtype=F64) * scale).to(dtype)
    if offset == 0:
        return values
    buf = torch.empty(values.numel() + offset, dtype=dtype, device="cuda")
    x = buf[offset:].view(shape)
    x.copy_(values)
    return x


def poisoned(shape, dtype, offset=0):
    x = rand(shape, dtype, offset=offset)
    return x.fill_(float("nan"))


def assert_rel(actual, expected, tol, what, magnitude=None):
    """||actual - expected|| < tol * ||expected||. With `magnitude` (same shape, float64): the
    sizes of the terms whose rounding makes the error, when they can be far larger than the
    result (a condition number), the bound is tol * max(||expected||, ||magnitude||)."""
    actual, expected = actual.double(), expected.double()
    assert torch.isfinite(actual).all(), f"{what}: non-finite values (unwritten?)"
    # A floor under ||ref|| for references that are (nearly) zero, e.g. LayerNorm of one column.
    floor = 1e-3 * expected.numel() ** 0.5
    scale = expected.norm().clamp_min(floor)
    if magnitude is not None:
        scale = torch.maximum(scale, magnitude.double().norm())
    err = ((actual - expected).norm() / scale).item()
    assert err < tol, f"{what}: relative error {err:.2e} >= {tol:.0e}"


def _gelu_grad_terms(z):
    """|s| + |2 z s (1 - s) u'| (s = sigmoid(2u)): the size of the two terms of GeLU's
    derivative, whose rounding the kernel's error follows."""
    z = z.detach()
    u_prime = (2 / torch.pi) ** 0.5 * (1 + 3 * 0.044715 * z * z)
    s = torch.sigmoid(2 * (2 / torch.pi) ** 0.5 * (z + 0.044715 * z**3))
    return s + (2 * z * s * (1 - s) * u_prime).abs()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, h", SHAPES)
@pytest.mark.parametrize("offset", OFFSETS)
def test_bias_gelu_kernels_match_float64(dtype, rows, h, offset):
    tol, cuda = TOL[dtype], kernels()
    x, bias = rand((rows, h), dtype, 2.0, offset), rand((h,), dtype)
    grad = rand((rows, h), dtype, 1.0, offset)
    z = (x.double() + bias.double()).requires_grad_()
    ref = F.gelu(z, approximate="tanh")
    ref.backward(grad.double())

    out = poisoned((rows, h), dtype, offset)
    launch(cuda.bias_gelu_forward, x, x, bias, out, x.numel(), h)
    grad_x = poisoned((rows, h), dtype, 1 - offset)  # aligned unlike x: the scalar path
    launch(cuda.bias_gelu_backward, x, grad, x, bias, grad_x, x.numel(), h)
    torch.cuda.synchronize()
    assert_rel(out, ref, tol, "forward")
    # GeLU's derivative crosses zero near z = -0.75, where its two terms cancel: with few
    # elements (one, in the first shape), bound by their size, as cpp/tests do per element.
    assert_rel(grad_x, z.grad, tol, "backward", magnitude=grad.double() * _gelu_grad_terms(z))


@pytest.mark.parametrize("dtype", DTYPES)
def test_bias_gelu_autograd_on_the_gpu_uses_the_kernel(dtype):
    assert cuda_kernel("bias_gelu_forward", torch.zeros(1, device="cuda", dtype=dtype))
    x, bias, g = (
        rand((64, 3072), dtype).requires_grad_(),
        rand((3072,), dtype),
        rand((64, 3072), dtype),
    )
    bias.requires_grad_()
    (bias_gelu(x, bias) * g).sum().backward()
    rx, rb = x.detach().double().requires_grad_(), bias.detach().double().requires_grad_()
    (F.gelu(rx + rb, approximate="tanh") * g.double()).sum().backward()
    assert_rel(x.grad, rx.grad, TOL[dtype], "x grad")
    assert_rel(bias.grad, rb.grad, TOL[dtype], "bias grad")


def layer_norm_grad_terms(s64, w64, g_out, rstd):
    """|each term| of d loss / d s = rstd (g - mean(g) - xhat mean(g xhat)), g = grad_out * w,
    in float64. The kernel rounds each term before they cancel, and rstd magnifies that rounding:
    with one column the gradient is exactly 0 while rstd = 1/sqrt(eps) ~ 316 times one rounding
    step of g remains, so the error is bounded relative to these terms, not to the gradient."""
    s = s64.detach()
    rs = rstd.double()[:, None]
    xhat = (s - s.mean(-1, keepdim=True)) * rs
    g = g_out.double() * w64.detach()
    mean_g = g.mean(-1, keepdim=True)
    mean_gx = (g * xhat).mean(-1, keepdim=True)
    return rs * (g.abs() + mean_g.abs() + (xhat * mean_gx).abs())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, h", SHAPES)
@pytest.mark.parametrize(
    "residual, has_bias, offset", [(True, True, 0), (True, False, 1), (False, True, 1)]
)
def test_add_layer_norm_kernels_match_float64(dtype, rows, h, residual, has_bias, offset):
    tol, cuda = TOL[dtype], kernels()
    x = rand((rows, h), dtype, 2.0, offset)
    r = rand((rows, h), dtype, 1.0, offset) if residual else None
    w = rand((h,), dtype, 1.0, offset)
    b = rand((h,), dtype, 1.0, offset) if has_bias else None
    out = poisoned((rows, h), dtype, offset)
    s = poisoned((rows, h), dtype, offset) if residual else None
    mean, rstd = poisoned((rows,), torch.float32), poisoned((rows,), torch.float32)
    launch(cuda.add_layer_norm_forward, x, x, r, w, b, out, s, mean, rstd, rows, h, 1e-5)
    torch.cuda.synchronize()
    if residual:
        assert_rel(s, x.double() + r.double(), tol, "sum")
    # The kernel normalises the sum as stored (rounded to dtype), as the unfused ops do.
    s64 = (x if s is None else s).double().requires_grad_()
    w64 = w.double().requires_grad_()
    b64 = None if b is None else b.double().requires_grad_()
    ref = F.layer_norm(s64, (h,), w64, b64, 1e-5)
    assert_rel(out, ref, tol, "forward")
    assert_rel(mean, s64.detach().mean(-1), 1e-4, "mean")  # near 0: looser
    var = s64.detach().var(-1, unbiased=False)
    assert_rel(rstd, (var + 1e-5).rsqrt(), 1e-5, "rstd")

    g_out = rand((rows, h), dtype, 1.0, offset)
    g_sum = rand((rows, h), dtype, 1.0, offset) if residual else None
    (ref * g_out.double()).sum().backward()
    expected = s64.grad if g_sum is None else s64.grad + g_sum.double()
    blocks = cuda.add_layer_norm_backward_blocks(rows, h, has_bias, KERNEL_DTYPES[dtype])
    assert 1 <= blocks <= rows
    grad_in = poisoned((rows, h), dtype, offset)
    gw = poisoned((h,), dtype, offset)
    gb = poisoned((h,), dtype, offset) if has_bias else None
    workspace = poisoned(((2 if has_bias else 1) * blocks * h,), torch.float32)
    src = x if s is None else s
    tensors = (g_out, g_sum, src, w, mean, rstd, grad_in, gw, gb, workspace)
    launch(cuda.add_layer_norm_backward, x, *tensors, rows, h, blocks)
    torch.cuda.synchronize()
    assert_rel(grad_in, expected, tol, "input grad", layer_norm_grad_terms(s64, w64, g_out, rstd))
    assert_rel(gw, w64.grad, tol, "weight grad")
    if has_bias:
        assert_rel(gb, b64.grad, tol, "bias grad")


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_layer_norm_autograd_on_the_gpu(dtype):
    h = 2048
    x, r = rand((300, h), dtype).requires_grad_(), rand((300, h), dtype).requires_grad_()
    w, b = rand((h,), dtype).requires_grad_(), rand((h,), dtype).requires_grad_()
    g_out, g_sum = rand((300, h), dtype), rand((300, h), dtype)
    out, s = add_layer_norm(x, r, w, b, 1e-5)
    ((out * g_out).sum() + (s * g_sum).sum()).backward()
    refs = [t.detach().double().requires_grad_() for t in (x, r, w, b)]
    s_ref = refs[0] + refs[1]
    out_ref = F.layer_norm(s_ref, (h,), refs[2], refs[3], 1e-5)
    ((out_ref * g_out.double()).sum() + (s_ref * g_sum.double()).sum()).backward()
    assert_rel(out, out_ref, TOL[dtype], "out")
    for mine, ref, name in zip((x, r, w, b), refs, "xrwb", strict=True):
        assert_rel(mine.grad, ref.grad, TOL[dtype], f"{name} grad")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, vocab", [(1, 1), (7, 13), (33, 1000), (5, 6288), (4, 50304)])
@pytest.mark.parametrize("offset, start", [(0, 0), (1, 7)])
def test_cross_entropy_kernels_match_float64(dtype, rows, vocab, offset, start):
    cuda = kernels()
    logits = rand((rows, vocab), dtype, 8.0, offset)
    if vocab > 10:
        logits[:, -5:] = float("-inf")  # padded vocabulary ids
    target = torch.randint(start, start + vocab, (rows,), device="cuda")
    target[0] = -100  # ignored: no rank holds it
    top, sum_exp, t_logit = (poisoned((rows,), torch.float32) for _ in range(3))
    launch(
        cuda.vocab_cross_entropy_forward,
        logits,
        logits,
        target,
        top,
        sum_exp,
        t_logit,
        rows,
        vocab,
        start,
    )
    ref_top, ref_sum, ref_t = cross_entropy_stats_reference(logits.double(), target, start)
    torch.cuda.synchronize()
    # The loss from these is exact given the stored logits: fp32 tolerance for every dtype.
    assert_rel(top, ref_top, 1e-6, "max")
    assert_rel(sum_exp, ref_sum, 1e-5, "sum of exponentials")
    torch.testing.assert_close(t_logit, ref_t.float(), rtol=0, atol=0)

    grad_loss = torch.rand(rows, device="cuda")
    grad_loss[0] = 0.0  # the ignored token's gradient, as the autograd Function masks it
    ref = (logits.double() - ref_top[:, None]).exp() / ref_sum[:, None]
    local = target - start
    hit = (local >= 0) & (local < vocab)
    ref[hit.nonzero()[:, 0], local[hit]] -= 1.0
    ref *= grad_loss.double()[:, None]
    launch(
        cuda.vocab_cross_entropy_backward,
        logits,
        logits,
        target,
        top,
        sum_exp,
        grad_loss,
        rows,
        vocab,
        start,
    )
    torch.cuda.synchronize()
    assert_rel(logits, ref, TOL[dtype], "logits grad (in place)")


@pytest.mark.parametrize("dtype", DTYPES)
def test_cross_entropy_forward_kernel_lets_nan_reach_the_sum(dtype):
    # Row 0: a NaN at the start of the first pack, the rest of that pack padding (-inf) and
    # finite values after it; row 1: padding and one NaN; row 2: no NaN. A maximum skips NaN, so
    # only the sum can carry it, as torch's logsumexp (and the CPU reference) do.
    cuda, vocab = kernels(), 64
    logits = rand((3, vocab), dtype)
    logits[0, :8] = float("-inf")
    logits[0, 0] = float("nan")
    logits[1] = float("-inf")
    logits[1, 5] = float("nan")
    target = torch.tensor([3, 5, 7], device="cuda")
    top, sum_exp, t_logit = (poisoned((3,), torch.float32) for _ in range(3))
    launch(
        cuda.vocab_cross_entropy_forward, logits, logits, target, top, sum_exp, t_logit, 3, vocab, 0
    )
    torch.cuda.synchronize()
    assert torch.isnan(sum_exp[:2]).all() and torch.isfinite(sum_exp[2])
    _, ref_sum, _ = cross_entropy_stats_reference(logits.double(), target, 0)
    assert torch.isnan(ref_sum[:2]).all()
    loss = fused_vocab_parallel_cross_entropy(logits.clone(), target, None)
    assert torch.isnan(loss[:2]).all() and torch.isfinite(loss[2])


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_cross_entropy_autograd_on_the_gpu(dtype):
    logits = rand((2, 300, 4000), dtype, 4.0)
    target = torch.randint(0, 4000, (2, 300), device="cuda")
    target[0, :7] = -100
    g = torch.rand(2, 300, device="cuda")
    a = logits.clone().requires_grad_()
    loss = fused_vocab_parallel_cross_entropy(a, target, None)
    (loss * g).sum().backward()
    ref_in = logits.double().requires_grad_()
    ref = F.cross_entropy(ref_in.view(-1, 4000), target.view(-1), reduction="none").view(2, 300)
    (ref * g.double()).sum().backward()
    assert loss.dtype == torch.float32
    assert_rel(loss, ref, 1e-5, "loss")
    assert_rel(a.grad, ref_in.grad, TOL[dtype], "logits grad")


def test_a_small_gpt_on_the_gpu_gives_the_same_loss_with_the_fusion_flags():
    import gpt_workers as gw
    from megart.models import GPT

    x = gw.tokens().cuda()
    results = []
    for flags in ({}, gw.FUSION_FLAGS):
        torch.manual_seed(0)
        model = GPT(gw.small_config(**flags)).cuda()
        loss = model(x[:, :-1], x[:, 1:])
        loss.backward()
        results.append((loss.item(), {n: p.grad for n, p in model.named_parameters()}))
    assert results[1][0] == pytest.approx(results[0][0], rel=1e-5)
    for name, g in results[0][1].items():
        torch.testing.assert_close(results[1][1][name], g, rtol=1e-4, atol=1e-5, msg=name)


def test_kernels_launch_on_torchs_current_stream():
    from megart.kernels._dispatch import current_raw_stream

    side = torch.cuda.Stream()
    assert current_raw_stream(0) == torch.cuda.current_stream(0).cuda_stream
    with torch.cuda.stream(side):
        assert current_raw_stream(0) == side.cuda_stream != torch.cuda.default_stream(0).cuda_stream
        # A fused op enqueued there, on an input just written there, gives the right result.
        x = torch.full((64, 256), 3.0, device="cuda")
        bias = torch.zeros(256, device="cuda")
        out = bias_gelu(x, bias)
    side.synchronize()
    expected = torch.nn.functional.gelu(torch.full((64, 256), 3.0), approximate="tanh")
    torch.testing.assert_close(out.cpu(), expected)
