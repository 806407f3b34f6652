"""Recomputation of MoE layers: full recomputation replays the router (its choice included),
the experts and the shared experts; selective recomputation's modules do as Megatron-Core's:
"mlp" checkpoints dense MLPs only, "moe" whole MoE layers, "shared_experts" the shared experts
within them. Each changes no gradient, and each runs again exactly what it names (counted by
forward hooks); "moe" under expert parallelism (its token exchanges replayed) follows the
one-process curve."""

import argparse

import pytest

import moe_workers as mw
import train_workers as tw
from megart import ConfigError
from megart.launcher import launch
from train_workers import SAME_RUN

MODEL = dict(num_experts=4, disable_bias_linear=True, moe_aux_loss_coeff=0.1,
             moe_z_loss_coeff=0.01, moe_layer_freq="2",
             moe_shared_expert_intermediate_size=24)  # fmt: skip
SELECTIVE = dict(recompute_granularity="selective")
# name: (flags, how many times each kind of module runs forward, as a multiple of a plain run's)
RUNS = {
    "full": (dict(recompute_granularity="full"),
             dict(router=2, moe=2, expert=2, shared_experts=2, dense_mlp=2)),
    "mlp": (dict(SELECTIVE, recompute_modules=["core_attn", "mlp"]),
            dict(router=1, moe=1, expert=1, shared_experts=1, dense_mlp=2)),
    "moe": (dict(SELECTIVE, recompute_modules=["moe"]),
            dict(router=2, moe=2, expert=2, shared_experts=2, dense_mlp=1)),
    "shared_experts": (dict(SELECTIVE, recompute_modules=["shared_experts"]),
                       dict(router=1, moe=1, expert=1, shared_experts=2, dense_mlp=1)),
    # Nested checkpoints: torch's non-reentrant checkpoint replays the inner one (the shared
    # experts) within the outer one's (the layer's) replay, not a third time.
    "moe-and-shared_experts": (dict(SELECTIVE, recompute_modules=["moe", "shared_experts"]),
                               dict(router=2, moe=2, expert=2, shared_experts=2, dense_mlp=1)),
}  # fmt: skip


@pytest.fixture(scope="module")
def plain():
    return launch(mw.forward_calls, 1, MODEL, timeout=300)[0]


def _same_gradients(a: dict, b: dict) -> bool:
    import torch

    return set(a) == set(b) and all(torch.allclose(a[n], b[n], rtol=1e-5, atol=1e-8) for n in a)


@pytest.mark.parametrize("name", RUNS)
def test_recomputation_changes_no_gradient_and_runs_again_what_it_names(plain, name):
    flags, times = RUNS[name]
    grads, calls = launch(mw.forward_calls, 1, dict(MODEL, **flags), timeout=300)[0]
    plain_grads, plain_calls = plain
    assert any(".router." in n for n in plain_grads)
    assert any(".shared_experts." in n for n in plain_grads)
    assert set(plain_calls) == set(times) and min(plain_calls.values()) > 0
    assert calls == {kind: n * times[kind] for kind, n in plain_calls.items()}
    assert _same_gradients(plain_grads, grads)


def test_moe_recomputation_under_expert_parallelism_follows_the_curve():
    """The replayed layer exchanges its tokens again, in step on both expert-parallel ranks."""
    train = dict(MODEL, moe_layer_freq="1", train_iters=4)
    one = launch(tw.train_kw, 1, train, timeout=300)[0]
    ep2 = launch(tw.train_kw, 2, dict(train, expert_model_parallel_size=2, **SELECTIVE,
                 recompute_modules=["moe", "shared_experts"]), timeout=300)[0]  # fmt: skip
    for key in ("loss", "grad_norm", "load_balancing_loss", "z_loss"):
        assert [h[key] for h in ep2] == pytest.approx([h[key] for h in one], **SAME_RUN), key


@pytest.mark.parametrize("module", ["moe", "shared_experts"])
def test_megart_plan_models_them(module):
    """No longer refused (tests/test_plan_moe_shared.py checks the bytes against real ranks):
    the plan keeps fewer activations and takes longer than without the module; layernorm with
    experts stays refused by name."""
    from megart.cli.train import add_arguments, config_from_args
    from megart.plan.estimate import estimate
    from megart.plan.flags import refuse_unmodelled
    from megart.plan.hardware import load_profile
    from megart.plan.layout import Layout

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    shape = ["--num-experts", "4", "--disable-bias-linear", "--moe-shared-expert-intermediate-size",
             "24", "--recompute-activations", "--recompute-modules", "core_attn"]  # fmt: skip
    config = config_from_args(parser.parse_args([*shape, module]))
    refuse_unmodelled(config)  # raises nothing
    plain = config_from_args(parser.parse_args(shape))
    layout = Layout(1, 1, 1, 1, 1, False, "selective", False)
    gpu = load_profile("h100-80gb")
    kept, replayed = estimate(plain, layout, gpu), estimate(config, layout, gpu)
    assert replayed.memory["saved"] < kept.memory["saved"]
    assert replayed.time["iteration"] > kept.time["iteration"]
    said = "megart plan does not model --recompute-modules core_attn layernorm with --num-experts"
    with pytest.raises(ConfigError, match=said):
        refuse_unmodelled(config_from_args(parser.parse_args([*shape, "layernorm"])))
