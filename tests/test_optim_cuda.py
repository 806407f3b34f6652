"""megart's CUDA AdamW against torch.optim.AdamW(fused=True). The GPU tests skip without one.

The CUDA kernels were written and compiled without a GPU: these tests are their first check.
"""

import copy

import pytest
import torch

from megart import ConfigError
from megart.optim import AdamW, LossScaler
from optim_helpers import SHAPES, assert_trajectory_close

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def cuda_params(seed, dtype=torch.float32, shapes=SHAPES):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen).to("cuda", dtype).requires_grad_(True) for s in shapes]


def set_cuda_grads(param_lists, seed):
    gen = torch.Generator().manual_seed(seed)
    for tensors in zip(*param_lists, strict=True):
        g = torch.randn(tensors[0].shape, generator=gen).cuda()
        for p in tensors:
            p.grad = g.to(p.dtype, copy=True)


@needs_gpu
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_cuda_adamw_matches_torch_fused(weight_decay):
    # Many tensors and one large one: more than one launch, tensors split across launches.
    shapes = [*SHAPES, *[(1000 + i,) for i in range(60)], (6_000_000,)]
    ours_params = cuda_params(0, shapes=shapes)
    theirs_params = [p.detach().clone().requires_grad_(True) for p in ours_params]
    ours = AdamW(ours_params, lr=1e-2, weight_decay=weight_decay)
    theirs = torch.optim.AdamW(theirs_params, lr=1e-2, weight_decay=weight_decay, fused=True)
    for step in range(40):
        set_cuda_grads([ours_params, theirs_params], seed=step)
        ours.step()
        theirs.step()
    torch.cuda.synchronize()
    assert_trajectory_close([p.cpu() for p in ours_params], [p.cpu() for p in theirs_params])
    for p in ours_params:
        assert ours.state[p]["step"].device == p.device
        assert ours.state[p]["step"].item() == 40.0


@needs_gpu
def test_cuda_bf16_master_weights_follow_fp32():
    low = cuda_params(1, torch.bfloat16)
    ref = [p.detach().float().requires_grad_(True) for p in low]
    ours = AdamW(low, lr=1e-2, master_weights=True)
    theirs = torch.optim.AdamW(ref, lr=1e-2, fused=True)
    for step in range(40):
        set_cuda_grads([low], seed=step)
        for r, p in zip(ref, low, strict=True):
            r.grad = p.grad.float()
        ours.step()
        theirs.step()
    for p, r in zip(low, ref, strict=True):
        master = ours.state[p]["master_param"]
        assert_trajectory_close([master.cpu()], [r.detach().cpu()], rtol=1e-5)
        assert torch.equal(p.detach(), master.bfloat16())


@needs_gpu
def test_cuda_found_inf_skips_step_without_host_sync():
    params = cuda_params(2)
    before = [p.detach().clone() for p in params]
    opt = AdamW(params)
    set_cuda_grads([params], seed=0)
    opt.step(found_inf=torch.ones(1, dtype=torch.int32, device="cuda"))
    torch.cuda.synchronize()
    for p, b in zip(params, before, strict=True):
        assert torch.equal(p.detach(), b)
        assert opt.state[p]["step"].item() == 0.0


@needs_gpu
def test_cuda_loss_scaler_and_state_dict_to_torch():
    params = cuda_params(3)
    opt = AdamW(params, lr=1e-2)
    scaler = LossScaler(init_scale=8.0, hysteresis=1)  # backs off at the first overflow
    set_cuda_grads([params], seed=0)
    params[0].grad.fill_(float("nan"))
    assert scaler.step(opt) is False
    assert scaler.scale == 4.0
    set_cuda_grads([params], seed=1)
    assert scaler.step(opt) is True
    theirs_params = [p.detach().clone().requires_grad_(True) for p in params]
    theirs = torch.optim.AdamW(theirs_params, fused=True)
    theirs.load_state_dict(copy.deepcopy(opt.state_dict()))
    for step in range(5):
        set_cuda_grads([params, theirs_params], seed=10 + step)
        opt.step()
        theirs.step()
    assert_trajectory_close([p.cpu() for p in params], [p.cpu() for p in theirs_params])


@needs_gpu
def test_cuda_loss_scaler_unscales_non_contiguous_grads():
    # A strided grad (every other column of a wider buffer) does not fit the kernel, which reads
    # numel() elements from each address: its group goes through torch instead.
    params = cuda_params(4, shapes=[(33, 65), (100,)])
    wide = torch.randn(33, 130, device="cuda")
    params[0].grad = wide[:, ::2]
    params[1].grad = torch.randn(100, device="cuda")
    assert not params[0].grad.is_contiguous()
    expected = [p.grad / 8.0 for p in params]
    found = LossScaler(init_scale=8.0).unscale_(params)
    assert found.item() == 0
    for p, e in zip(params, expected, strict=True):
        torch.testing.assert_close(p.grad, e, rtol=0, atol=0)
    wide[0, 0] = float("inf")
    assert LossScaler(init_scale=8.0).unscale_(params).item() == 1


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cuda_multi_tensor_scale_of_every_dtype_matches_torch(dtype):
    # Sizes around the kernel's 128-bit packs and its 65536-element chunks, one tensor starting
    # one element past 16-byte alignment (the scalar path), exact products (a power of two).
    from megart.optim import multi_tensor_scale_

    sizes = [1, 7, 8, 65535, 65536, 65537, 3 * 65536 + 5]
    xs = [torch.randn(n, device="cuda").to(dtype) for n in sizes]
    buf = torch.randn(1001, device="cuda").to(dtype)
    xs.append(buf[1:])
    expected = [x * 0.125 for x in xs]
    assert multi_tensor_scale_(xs, xs, 0.125).item() == 0
    for x, e in zip(xs, expected, strict=True):
        torch.testing.assert_close(x, e, rtol=0, atol=0)
    xs[5][-1] = float("inf")
    assert multi_tensor_scale_(xs, xs, 1.0).item() == 1


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_loaded_state_of_another_shape_is_refused(device):
    # torch's load_state_dict checks parameter counts, not shapes; the sweeps would read and
    # write past the end of a smaller loaded moment.
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    small = [torch.zeros(4, device=device, requires_grad=True)]
    opt = AdamW(small)
    small[0].grad = torch.ones(4, device=device)
    opt.step()
    large = [torch.zeros(400, device=device, requires_grad=True)]
    other = AdamW(large)
    other.load_state_dict(opt.state_dict())
    large[0].grad = torch.ones(400, device=device)
    with pytest.raises(ConfigError, match="shape"):
        other.step()
