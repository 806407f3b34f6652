"""bf16/fp16 parameters with fp32 main weights against an fp32 reference."""

import copy

import pytest
import torch

from megart.optim import AdamW
from optim_helpers import SHAPES, assert_trajectory_close, make_params, set_grads


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_params_follow_fp32_reference(dtype):
    ref_params = make_params(seed=4)
    low_params = [p.detach().to(dtype).requires_grad_(True) for p in ref_params]
    # The reference starts from the same (rounded) values and sees the same rounded gradients.
    ref_params = [p.detach().float().requires_grad_(True) for p in low_params]
    ours = AdamW(low_params, lr=1e-2, weight_decay=0.1, master_weights=True)
    ref = torch.optim.AdamW(ref_params, lr=1e-2, weight_decay=0.1)
    for step in range(40):
        set_grads([low_params], seed=step)
        for r, p in zip(ref_params, low_params, strict=True):
            r.grad = p.grad.float()
        ours.step()
        ref.step()
        for r, p in zip(ref_params, low_params, strict=True):
            master = ours.state[p]["master_param"]
            # The main weights follow the fp32 optimizer; the model copy is their rounding.
            assert_trajectory_close([master], [r])
            assert torch.equal(p.detach(), master.to(dtype))
            assert ours.state[p]["exp_avg"].dtype == torch.float32


def test_bf16_params_track_fp32_within_bf16_tolerance():
    ref_params = make_params(seed=5)
    low_params = [p.detach().to(torch.bfloat16).requires_grad_(True) for p in ref_params]
    ours = AdamW(low_params, lr=1e-3, master_weights=True)
    ref = torch.optim.AdamW(ref_params, lr=1e-3)
    for step in range(40):
        set_grads([ref_params, low_params], seed=step)
        ours.step()
        ref.step()
    for p, r in zip(low_params, ref_params, strict=True):
        torch.testing.assert_close(p.float(), r.detach(), rtol=1.6e-2, atol=1e-2)


def test_master_weights_survive_state_dict_round_trip():
    low_params = [p.detach().bfloat16().requires_grad_(True) for p in make_params(seed=6)]
    ours = AdamW(low_params, lr=1e-2, master_weights=True)
    for step in range(5):
        set_grads([low_params], seed=step)
        ours.step()
    sd = copy.deepcopy(ours.state_dict())
    other_params = [p.detach().clone().requires_grad_(True) for p in low_params]
    other = AdamW(other_params, master_weights=True)
    other.load_state_dict(sd)
    for p, q in zip(low_params, other_params, strict=True):
        for key in ("exp_avg", "exp_avg_sq", "master_param"):
            assert other.state[q][key].dtype == torch.float32
            assert torch.equal(other.state[q][key], ours.state[p][key])
    for step in range(5):
        set_grads([low_params, other_params], seed=100 + step)
        ours.step()
        other.step()
    for p, q in zip(low_params, other_params, strict=True):
        assert torch.equal(p, q)


def test_torch_bf16_state_loads_into_master_weights():
    params = [p.detach().bfloat16().requires_grad_(True) for p in make_params(seed=7)]
    theirs = torch.optim.AdamW(params, lr=1e-2)
    set_grads([params], seed=0)
    theirs.step()
    ours_params = [p.detach().clone().requires_grad_(True) for p in params]
    ours = AdamW(ours_params, master_weights=True)
    ours.load_state_dict(copy.deepcopy(theirs.state_dict()))
    set_grads([ours_params], seed=1)
    ours.step()
    assert len(ours_params) == len(SHAPES)
    for p in ours_params:
        state = ours.state[p]
        assert state["step"].item() == 2.0
        assert state["master_param"].dtype == torch.float32
        assert torch.equal(p.detach(), state["master_param"].bfloat16())
