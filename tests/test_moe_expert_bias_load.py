"""A checkpoint's expert biases (--moe-router-enable-expert-bias, models.moe_router) are never
dropped by a resume: one saved with them and resumed without the flag is refused by name in
each of megart's formats (Megatron-Core's strict load refuses its persistent buffers' absence
too), while one saved without them resumes with the flag from zero biases, as a new run's.
Zero biases route as no biases do, so that resume's first iteration is the biasless run's."""

import pytest
import torch

import moe_router_workers as rw
from megart.launcher import LaunchError, launch
from train_workers import SAME_RUN

SIGMOID = dict(num_experts=4, disable_bias_linear=True, moe_router_score_function="sigmoid",
               moe_aux_loss_coeff=0.01)  # fmt: skip
BIASED = dict(SIGMOID, moe_router_enable_expert_bias=True)
FORMATS = ["megart", "torch", "torch_dist"]


def _save(tmp_path, kw: dict, fmt: str) -> str:
    store = str(tmp_path / f"ckpt-{fmt}")
    launch(rw.train_bias, 1, dict(kw, train_iters=4, exit_interval=2, save=store,
                                  ckpt_format=fmt), timeout=300)  # fmt: skip
    return store


@pytest.mark.parametrize("fmt", FORMATS)
def test_resuming_without_the_flag_is_refused_by_name(tmp_path, fmt):
    store = _save(tmp_path, BIASED, fmt)
    with pytest.raises(LaunchError, match="--moe-router-enable-expert-bias .now without it: its "
                       "biases would be lost"):  # fmt: skip
        launch(rw.train_bias, 1, dict(SIGMOID, train_iters=4, load=store), timeout=300)


@pytest.mark.parametrize("fmt", FORMATS)
def test_resuming_with_the_flag_starts_from_zero_biases(tmp_path, fmt):
    store = _save(tmp_path, SIGMOID, fmt)
    plain = launch(rw.train_bias, 1, dict(SIGMOID, train_iters=4), timeout=300)[0]
    got = launch(rw.train_bias, 1, dict(BIASED, train_iters=4, load=store), timeout=300)[0]
    assert [h["iteration"] for h in got["history"]] == [3, 4]
    # Iteration 3 routes with zero biases (the biasless run's choices); then they move.
    assert got["history"][0]["loss"] == pytest.approx(plain["history"][2]["loss"], **SAME_RUN)
    assert torch.count_nonzero(got["bias"]) > 0


def test_megatron_core_loads_the_distributed_optimizers_file_with_expert_biases(tmp_path):
    """The routers' expert biases are buffers, in the legacy model files but outside
    Megatron-Core's gradient buffers: its DistributedOptimizer loads megart's distrib_optim.pt
    of such a model (dp2) holding megart's fp32 weights and moments exactly, every parameter
    tiled by the ranks' pieces (counting the biases in the buffers made it refuse the file)."""
    import megatron_distopt_workers as mdw

    kw = dict(BIASED, train_iters=4, use_distributed_optimizer=True)
    ref, ours = str(tmp_path / "ref"), str(tmp_path / "ours")
    launch(rw.tw.train_kw, 2, dict(kw, save=ref, save_interval=2), timeout=300)
    launch(rw.tw.train_kw, 2, dict(kw, save=ours, save_interval=2, exit_interval=2,
                                   ckpt_format="torch"), timeout=300)  # fmt: skip
    ranks = launch(mdw.load_and_write, 2, kw, ours, ref, None, timeout=300)
    pieces: dict[str, list] = {}
    for r in ranks:
        for (_, name), piece in r["pieces"].items():
            assert piece["diffs"] == dict(param=0.0, exp_avg=0.0, exp_avg_sq=0.0), name
            pieces.setdefault(name, []).append((*piece["range"], piece["numel"]))
    assert any(".mlp.router.weight" in n for n in pieces)
    assert not any("expert_bias" in n for n in pieces)
    for name, held in pieces.items():
        held.sort()
        assert held[0][0] == 0 and held[-1][1] == held[-1][2], name
        assert all(a[1] == b[0] for a, b in zip(held, held[1:], strict=False)), name
