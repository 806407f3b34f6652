"""The CUDA kernels against torch eager. They need a GPU and skip cleanly without one; the CUDA
sources still compile in every build where nvcc is found."""

import pytest
import torch

import megart

cuda_built = megart.build_info()["cuda_compiled"]
needs_gpu = pytest.mark.skipif(
    not (cuda_built and torch.cuda.is_available()), reason="needs megart._cuda and a CUDA GPU"
)


def test_cuda_module_reports_its_toolkit_when_built():
    if not cuda_built:
        pytest.skip("built without a CUDA toolkit")
    from megart import _cuda

    major, minor = (int(x) for x in _cuda.toolkit_version().split("."))
    assert major >= 11 and minor >= 0
    assert _cuda.device_count() == torch.cuda.device_count()


@needs_gpu
@pytest.mark.parametrize("sizes", [[1], [7, 4097], [16384 * 321 + 3, 5, 0, 65536] + [33] * 40])
def test_multi_tensor_scale_matches_torch(sizes):
    from megart.optim import multi_tensor_scale_

    g = torch.Generator(device="cuda").manual_seed(0)
    xs = [torch.randn(n, device="cuda", generator=g) for n in sizes]
    expected = [x * 0.125 for x in xs]
    outs = [torch.full_like(x, float("nan")) for x in xs]  # poisoned
    found = multi_tensor_scale_(xs, outs, 0.125)
    assert not found
    for out, ref in zip(outs, expected, strict=True):
        torch.testing.assert_close(out, ref, rtol=0, atol=0)
    xs[-1][0] = float("inf")
    assert multi_tensor_scale_(xs, outs, 0.125)


@pytest.mark.parametrize("devices", [("cpu", "cpu", "cpu"), ("cuda", "cpu", "cuda")])
def test_multi_tensor_scale_torch_path(devices):
    # float64 on the CPU; or float32 on several devices, which one kernel launch cannot take.
    if "cuda" in devices and not (cuda_built and torch.cuda.is_available()):
        pytest.skip("needs megart._cuda and a CUDA GPU")
    from megart.optim import multi_tensor_scale_

    dtype = torch.float32 if "cuda" in devices else torch.float64
    xs = [torch.randn(n, dtype=dtype, device=d) for n, d in zip((1, 7, 4097), devices, strict=True)]
    outs = [torch.empty_like(x) for x in xs]
    assert not multi_tensor_scale_(xs, outs, 3.0)
    for x, y in zip(xs, outs, strict=True):
        torch.testing.assert_close(y, x * 3.0, rtol=0, atol=0)
    xs[1][3] = float("nan")
    assert multi_tensor_scale_(xs, outs, 3.0)


def test_multi_tensor_scale_refuses_mismatched_outputs():
    from megart import ConfigError
    from megart.optim import multi_tensor_scale_

    with pytest.raises(ConfigError, match="does not match"):
        multi_tensor_scale_([torch.zeros(3)], [torch.zeros(4)], 1.0)
    with pytest.raises(ConfigError, match="2 inputs but 1 outputs"):
        multi_tensor_scale_([torch.zeros(3)] * 2, [torch.zeros(3)], 1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_multi_tensor_scale_on_cpu_matches_torch_in_place_and_strided(dtype):
    # Contiguous tensors take the C++ sweep, a strided one torch's kernel: both bitwise torch.
    from megart.optim import multi_tensor_scale_

    xs = [torch.randn(n, dtype=dtype) for n in (1, 7, 4097)] + [torch.randn(6, 8, dtype=dtype).t()]
    expected = [x * 0.3 for x in xs]
    found = multi_tensor_scale_(xs, xs, 0.3)
    assert found.dtype == torch.int32 and found.item() == 0
    for x, e in zip(xs, expected, strict=True):
        torch.testing.assert_close(x, e, rtol=0, atol=0)
    xs[3][1, 2] = float("inf")
    assert multi_tensor_scale_(xs, xs, 0.3).item() == 1
    xs[3][1, 2] = 0.0
    xs[0][0] = float("nan")
    assert multi_tensor_scale_(xs, xs, 0.3).item() == 1


def test_multi_tensor_scale_binding_refuses_a_null_flag():
    # Checked before anything touches a GPU: a null flag would fault in the kernel on inf/NaN.
    if not cuda_built:
        pytest.skip("built without a CUDA toolkit")
    from megart import ConfigError, _cuda

    with pytest.raises(ConfigError, match="found_nonfinite"):
        _cuda.multi_tensor_scale([], [], [], "float32", 1.0, 0, 0)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_bias_gelu_of_an_empty_last_dimension(device):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from megart.kernels import bias_gelu

    x = torch.zeros(3, 0, device=device, requires_grad=True)
    bias = torch.zeros(0, device=device, requires_grad=True)
    y = bias_gelu(x, bias)
    y.sum().backward()
    assert y.shape == (3, 0) and x.grad.shape == (3, 0) and bias.grad.shape == (0,)
