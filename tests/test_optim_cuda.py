"""megart's CUDA AdamW against torch.optim.AdamW(fused=True). Needs a GPU; skipped without one.

The CUDA kernels were written and compiled without a GPU: these tests are their first check.
"""

import copy

import pytest
import torch

from megart.optim import AdamW, LossScaler
from optim_helpers import SHAPES, assert_trajectory_close

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def cuda_params(seed, dtype=torch.float32, shapes=SHAPES):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen).to("cuda", dtype).requires_grad_(True) for s in shapes]


def set_cuda_grads(param_lists, seed):
    gen = torch.Generator().manual_seed(seed)
    for tensors in zip(*param_lists, strict=True):
        g = torch.randn(tensors[0].shape, generator=gen).cuda()
        for p in tensors:
            p.grad = g.to(p.dtype, copy=True)


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


def test_cuda_loss_scaler_and_state_dict_to_torch():
    params = cuda_params(3)
    opt = AdamW(params, lr=1e-2)
    scaler = LossScaler(init_scale=8.0)
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
