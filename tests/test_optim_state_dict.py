"""State dicts move between megart.optim.AdamW and torch.optim.AdamW and training continues."""

import copy

import torch

from megart.optim import Adam, AdamW
from optim_helpers import assert_trajectory_close, clone_params, make_params, set_grads


def train(opt, params, steps, seed):
    for step in range(steps):
        set_grads([params], seed=seed + step)
        opt.step()


def test_state_keys_and_types_match_torch():
    ours_params = make_params()
    theirs_params = clone_params(ours_params)
    ours = AdamW(ours_params, lr=1e-2)
    theirs = torch.optim.AdamW(theirs_params, lr=1e-2)
    train(ours, ours_params, 3, 0)
    train(theirs, theirs_params, 3, 0)
    ours_sd, theirs_sd = ours.state_dict(), theirs.state_dict()
    assert ours_sd["state"].keys() == theirs_sd["state"].keys()
    for key, state in ours_sd["state"].items():
        assert state.keys() == theirs_sd["state"][key].keys() == {"step", "exp_avg", "exp_avg_sq"}
        step = state["step"]
        assert step.dtype == torch.float32 and step.dim() == 0 and step.item() == 3.0
    assert set(theirs_sd["param_groups"][0]) <= set(ours_sd["param_groups"][0])


def test_torch_to_megart_continues_like_torch():
    theirs_params = make_params(seed=1)
    ours_params = clone_params(theirs_params)
    theirs = torch.optim.AdamW(theirs_params, lr=1e-2, weight_decay=0.05)
    train(theirs, theirs_params, 20, 0)
    for p, q in zip(ours_params, theirs_params, strict=True):
        p.data.copy_(q.data)
    ours = AdamW(ours_params)
    ours.load_state_dict(copy.deepcopy(theirs.state_dict()))
    assert ours.param_groups[0]["lr"] == 1e-2
    assert ours.param_groups[0]["weight_decay"] == 0.05
    for step in range(25):
        set_grads([ours_params, theirs_params], seed=1000 + step)
        ours.step()
        theirs.step()
        assert_trajectory_close(ours_params, theirs_params)


def test_megart_to_torch_continues_like_megart():
    ours_params = make_params(seed=2)
    theirs_params = clone_params(ours_params)
    ours = AdamW(ours_params, lr=2e-3, betas=(0.85, 0.995))
    train(ours, ours_params, 20, 0)
    for p, q in zip(ours_params, theirs_params, strict=True):
        q.data.copy_(p.data)
    theirs = torch.optim.AdamW(theirs_params)
    theirs.load_state_dict(copy.deepcopy(ours.state_dict()))
    assert theirs.param_groups[0]["betas"] == (0.85, 0.995)
    for step in range(25):
        set_grads([ours_params, theirs_params], seed=2000 + step)
        ours.step()
        theirs.step()
        assert_trajectory_close(ours_params, theirs_params)


def test_adam_round_trip_with_torch_adam():
    ours_params = make_params(seed=3)
    theirs_params = clone_params(ours_params)
    ours = Adam(ours_params, lr=1e-2, weight_decay=0.1)
    train(ours, ours_params, 10, 0)
    for p, q in zip(ours_params, theirs_params, strict=True):
        q.data.copy_(p.data)
    theirs = torch.optim.Adam(theirs_params)
    theirs.load_state_dict(copy.deepcopy(ours.state_dict()))
    assert theirs.param_groups[0]["decoupled_weight_decay"] is False
    back = Adam(clone_params(theirs_params))
    back.load_state_dict(copy.deepcopy(theirs.state_dict()))
    for step in range(10):
        set_grads([ours_params, theirs_params], seed=3000 + step)
        ours.step()
        theirs.step()
    assert_trajectory_close(ours_params, theirs_params)
