"""megart.optim.AdamW / Adam follow torch.optim.AdamW / Adam step for step (CPU, fp32)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import megart
from megart.optim import Adam, AdamW
from optim_helpers import assert_trajectory_close, clone_params, make_params, set_grads


def run_pair(ours, theirs, ours_params, theirs_params, steps, on_step=None):
    for step in range(steps):
        set_grads([ours_params, theirs_params], seed=100 + step)
        if on_step is not None:
            on_step(step, ours, theirs)
        ours.step()
        theirs.step()
        assert_trajectory_close(ours_params, theirs_params)


@pytest.mark.parametrize("weight_decay", [0.0, 1e-2, 0.3])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_adamw_matches_torch_over_50_steps(weight_decay, threads):
    ours_params = make_params()
    theirs_params = clone_params(ours_params)
    ours = AdamW(ours_params, lr=1e-2, weight_decay=weight_decay, num_threads=threads)
    theirs = torch.optim.AdamW(theirs_params, lr=1e-2, weight_decay=weight_decay)
    run_pair(ours, theirs, ours_params, theirs_params, steps=50)
    for p, q in zip(ours_params, theirs_params, strict=True):
        assert ours.state[p]["step"].item() == theirs.state[q]["step"].item() == 50.0
        assert_trajectory_close([ours.state[p]["exp_avg"]], [theirs.state[q]["exp_avg"]])
        assert_trajectory_close([ours.state[p]["exp_avg_sq"]], [theirs.state[q]["exp_avg_sq"]])


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_adam_l2_matches_torch(weight_decay):
    ours_params = make_params(seed=3)
    theirs_params = clone_params(ours_params)
    ours = Adam(ours_params, lr=3e-3, betas=(0.8, 0.99), eps=1e-6, weight_decay=weight_decay)
    theirs = torch.optim.Adam(
        theirs_params, lr=3e-3, betas=(0.8, 0.99), eps=1e-6, weight_decay=weight_decay
    )
    run_pair(ours, theirs, ours_params, theirs_params, steps=45)


def test_beta1_below_half_uses_torch_lerp_branch():
    ours_params = make_params(seed=4)
    theirs_params = clone_params(ours_params)
    ours = AdamW(ours_params, lr=1e-2, betas=(0.3, 0.9))
    theirs = torch.optim.AdamW(theirs_params, lr=1e-2, betas=(0.3, 0.9))
    run_pair(ours, theirs, ours_params, theirs_params, steps=40)


def test_param_groups_and_lr_changes_mid_run():
    ours_params = make_params(seed=5)
    theirs_params = clone_params(ours_params)

    def groups(ps):
        return [
            {"params": ps[:2]},
            {"params": ps[2:4], "lr": 5e-3, "weight_decay": 0.2, "betas": (0.85, 0.98)},
            {"params": ps[4:], "eps": 1e-4},
        ]

    ours = AdamW(groups(ours_params), lr=1e-2)
    theirs = torch.optim.AdamW(groups(theirs_params), lr=1e-2)

    def change_lr(step, *opts):
        if step in (10, 25):
            for opt in opts:
                for g in opt.param_groups:
                    g["lr"] *= 0.5
        if step == 30:  # a scheduler between steps takes effect too
            for opt in opts:
                opt.param_groups[1]["weight_decay"] = 0.0

    run_pair(ours, theirs, ours_params, theirs_params, steps=40, on_step=change_lr)


def test_lr_scheduler_drives_megart_like_torch():
    ours_params = make_params(seed=6)
    theirs_params = clone_params(ours_params)
    ours = AdamW(ours_params, lr=1e-2)
    theirs = torch.optim.AdamW(theirs_params, lr=1e-2)
    scheds = [torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=40) for o in (ours, theirs)]
    for step in range(40):
        set_grads([ours_params, theirs_params], seed=step)
        ours.step()
        theirs.step()
        for s in scheds:
            s.step()
        assert_trajectory_close(ours_params, theirs_params)


def test_params_without_grad_are_left_alone():
    ours_params = make_params(seed=7)
    theirs_params = clone_params(ours_params)
    ours = AdamW(ours_params, lr=1e-2)
    theirs = torch.optim.AdamW(theirs_params, lr=1e-2)
    for step in range(42):
        set_grads([ours_params, theirs_params], seed=step)
        if step % 3 == 0:  # the third parameter misses some steps: its own step count lags
            ours_params[2].grad = None
            theirs_params[2].grad = None
        ours.step()
        theirs.step()
    assert_trajectory_close(ours_params, theirs_params)
    assert ours.state[ours_params[2]]["step"].item() == 28.0


@settings(max_examples=25, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 70_000), min_size=1, max_size=6),
    lr=st.floats(1e-4, 1e-1),
    weight_decay=st.floats(0.0, 0.5),
    decoupled=st.booleans(),
    threads=st.integers(1, 4),
)
def test_random_layouts_match_torch(sizes, lr, weight_decay, decoupled, threads):
    ours_params = make_params(shapes=[(n,) for n in sizes], seed=len(sizes))
    theirs_params = clone_params(ours_params)
    cls, ref = (AdamW, torch.optim.AdamW) if decoupled else (Adam, torch.optim.Adam)
    ours = cls(ours_params, lr=lr, weight_decay=weight_decay, num_threads=threads)
    theirs = ref(theirs_params, lr=lr, weight_decay=weight_decay)
    run_pair(ours, theirs, ours_params, theirs_params, steps=5)


def test_closure_is_called_and_returned():
    w = torch.zeros(3, requires_grad=True)
    opt = AdamW([w], lr=0.1)

    def closure():
        opt.zero_grad()
        loss = ((w - 1.0) ** 2).sum()
        loss.backward()
        return loss

    assert opt.step(closure).item() == 3.0
    assert torch.all(w > 0)


def test_unsupported_options_raise_config_error():
    p = torch.zeros(2, requires_grad=True)
    with pytest.raises(megart.ConfigError, match="amsgrad"):
        AdamW([p], amsgrad=True)
    with pytest.raises(ValueError, match="learning rate"):
        AdamW([p], lr=-1.0)
    with pytest.raises(megart.ConfigError, match="beta"):
        Adam([p], betas=(1.0, 0.9))
    opt = AdamW([p])
    opt.param_groups[0]["amsgrad"] = True
    p.grad = torch.ones(2)
    with pytest.raises(megart.ConfigError, match="amsgrad"):
        opt.step()


def test_bad_tensors_raise_config_error():
    p = torch.zeros(2, requires_grad=True, device="meta")
    p.grad = torch.zeros(2, device="meta")
    with pytest.raises(megart.ConfigError, match="cpu"):
        AdamW([p]).step()
    q = torch.zeros(2, dtype=torch.float64, requires_grad=True)
    q.grad = torch.zeros(2, dtype=torch.float64)
    with pytest.raises(megart.ConfigError, match="float64"):
        AdamW([q]).step()
    r = torch.zeros(4, 3).t().requires_grad_(True)
    r.grad = torch.zeros(3, 4)
    with pytest.raises(megart.ConfigError, match="contiguous"):
        AdamW([r]).step()
    b = torch.zeros(4, dtype=torch.bfloat16, requires_grad=True)
    b.grad = torch.zeros(4, dtype=torch.bfloat16)
    with pytest.raises(megart.ConfigError, match="master_weights=True"):
        AdamW([b]).step()


def test_thread_count_from_environment(monkeypatch):
    from megart import _core

    monkeypatch.setenv("MEGART_NUM_THREADS", "3")
    assert _core.optim.resolve_threads(0) == 3
    assert _core.optim.resolve_threads(5) == 5
    monkeypatch.setenv("MEGART_NUM_THREADS", "many")
    with pytest.raises(megart.ConfigError, match="MEGART_NUM_THREADS"):
        _core.optim.resolve_threads(0)
