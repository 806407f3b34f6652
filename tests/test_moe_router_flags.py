"""--moe-input-jitter-eps, --moe-router-force-load-balancing and --moe-per-layer-logging
(Megatron-Core 0.16.1's router options and its tracker's per-layer values): the layer against a
float64 reference given the same noise; megart train's runs under tp2 with sequence
parallelism, pp2, dp2, cp2, ep2 and full recomputation under pp2 on the one-process curve, with
each layer's logged losses the one-process run's; each comparison catches a mistake made on
purpose (moe_router_flags_workers.MISTAKES)."""

import pytest

import moe_router_flags_workers as fw
from megart.launcher import LaunchError, launch
from megart.training.moe_metrics import layer_names
from train_workers import SAME_RUN

# Layer 2 dense (its per-layer values 0, as Megatron-Core's tracker writes them).
MODEL = dict(num_experts=4, disable_bias_linear=True, moe_layer_freq="[1,1,0,1]",
             moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001, moe_input_jitter_eps=0.1,
             moe_router_force_load_balancing=True, moe_per_layer_logging=True,
             train_iters=3, eval_iters=1, eval_interval=3)  # fmt: skip
TP2 = dict(tensor_model_parallel_size=2, sequence_parallel=True)
PP2 = dict(pipeline_model_parallel_size=2)
# name: (processes, flags, mistake or None, the rank whose figures to read)
RUNS = {
    "tp2-sp": (2, TP2, None, 0),
    "pp2": (2, PP2, None, -1),
    "dp2": (2, {}, None, 0),
    "cp2": (2, dict(context_parallel_size=2), None, 0),
    "ep2": (2, dict(expert_model_parallel_size=2), None, 0),
    "pp2-recompute-full": (2, dict(PP2, recompute_granularity="full"), None, -1),
    # The mistakes this exists to catch.
    "tp2-sp-noise-per-tp-rank": (2, TP2, "noise-per-tp-rank", 0),
    "pp2-local-layer": (2, PP2, "local-layer", -1),
}  # fmt: skip
LOSSES = ("load_balancing_loss", "z_loss")


@pytest.mark.parametrize("kind", ["jitter", "force"])
def test_the_layer_equals_a_float64_reference_given_the_same_noise(kind):
    """The jittered router input, or the random logits (gradients straight through to the
    router's product), then top-k routing of the layer's experts: output and every gradient
    as the reference's; the noise is noise (spread), and the router still learns."""
    r = fw.layer_against_reference(kind)
    assert r["output"] < 1e-12 and r["grads"] < 1e-12, r
    assert r["noise_spread"] > (0.05 if kind == "jitter" else 1.0), r
    assert r["router_grad"] > 1e-6, r


def test_the_jitter_is_absent_in_evaluation():
    """In evaluation the jittered layer is the plain one exactly; in training mode (what a
    layer that left the jitter on would give in evaluation) it is not."""
    r = fw.layer_against_reference("jitter")
    assert r["eval"] == 0.0
    assert r["left_on"] > 1e-6


@pytest.fixture(scope="module")
def one_process():
    return launch(fw.train_flags, 1, MODEL, timeout=300)[0]


@pytest.fixture(scope="module")
def runs():
    return {
        name: launch(fw.train_flags, n, dict(MODEL, **kw), mistake, timeout=300)[rank]
        for name, (n, kw, mistake, rank) in RUNS.items()
    }


def per_layer(history: list[dict]) -> list[float]:
    """Every iteration's per-layer values, in one list."""
    return [h[k] for h in history for name in LOSSES for k in layer_names(name, 4)]


@pytest.mark.parametrize("name", [n for n, c in RUNS.items() if c[2] is None])
def test_every_layout_follows_the_one_process_curve_and_layers(one_process, runs, name):
    """The same noise for every token under each layout: the one-process losses (training and
    the random routing's validation loss) and each layer's logged auxiliary losses."""
    want, got = one_process, runs[name]
    assert [h["loss"] for h in got] == pytest.approx([h["loss"] for h in want], **SAME_RUN)
    valid = [h["valid_loss"] for h in want if "valid_loss" in h]
    assert valid and [h["valid_loss"] for h in got if "valid_loss" in h] == pytest.approx(
        valid, **SAME_RUN
    )
    assert per_layer(got) == pytest.approx(per_layer(want), **SAME_RUN)


def test_the_per_layer_values_are_megatrons_names_and_their_mean_is_the_logged_loss(one_process):
    """Every layer's value under moe/{name}_layer_{i}, the dense layer's 0, the MoE layers'
    near the balanced 1 (random logits) and their mean the logged value."""
    for h in one_process:
        for name in LOSSES:
            values = [h[k] for k in layer_names(name, 4)]
            assert values[2] == 0.0 and all(v > 0.1 for v in values[:2] + values[3:])
            mean = (values[0] + values[1] + values[3]) / 3
            assert h[name] == pytest.approx(mean, rel=1e-12, abs=0)
        assert h["load_balancing_loss"] == pytest.approx(1.0, abs=0.05)


def test_the_noise_changes_the_run(one_process):
    """Without the noise the curve is another (so the layouts' agreement says something)."""
    plain = dict(MODEL, moe_input_jitter_eps=None, moe_router_force_load_balancing=False)
    other = launch(fw.train_flags, 1, plain, timeout=300)[0]
    assert [h["loss"] for h in other] != pytest.approx([h["loss"] for h in one_process], rel=1e-4)


def test_the_curve_catches_noise_drawn_per_tensor_parallel_rank(one_process, runs):
    want = [h["loss"] for h in one_process]
    assert [h["loss"] for h in runs["tp2-sp-noise-per-tp-rank"]] != pytest.approx(want, rel=1e-4)


def test_recomputation_catches_noise_not_replayed():
    """Named before its forward only, a microbatch's recomputation under pp2's 1F1B draws the
    noise of the microbatch that ran last: other routing, which torch's checkpoint refuses."""
    kw = dict(MODEL, **PP2, recompute_granularity="full")
    with pytest.raises(LaunchError, match="Recomputed values"):
        launch(fw.train_flags, 2, kw, "no-replay", timeout=300)


def test_the_per_layer_values_catch_a_stages_local_layer_numbers(one_process, runs):
    """Tracked under chunk-local numbers, pp2's second stage's layers land on layers 0 and 1:
    the per-layer values differ while the logged means stay right."""
    got, want = runs["pp2-local-layer"], one_process
    assert per_layer(got) != pytest.approx(per_layer(want), rel=1e-4)
    assert [h["z_loss"] for h in got] == pytest.approx([h["z_loss"] for h in want], **SAME_RUN)
