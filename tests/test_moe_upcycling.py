"""--moe-use-upcycling (megart.training.upcycling): a dense GPT's weights upcycled as Megatron-Core
0.16.1's upcycling_utils does it (float64, CPU, every tensor bitwise), the upcycled model's logits
the dense model's where Megatron's arrangement makes them equal, and megart train upcycling a
dense checkpoint on a curve that no layout changes (one process, ep2, pp2, tp2 with sequence
parallelism), its first loss the dense model's. The mistakes the tests exist for (the G slices
in blocks rather than Megatron's e mod G; every layer's experts from the first layer's MLP) are
caught; what upcycling cannot do is refused by name."""

import pytest

import train_workers as tw
import upcycling_workers as uw
from megart import ConfigError
from megart.launcher import launch
from train_workers import SAME_RUN

BASE = dict(vocab_size=64, seq_length=8, hidden_size=16, num_layers=2, num_attention_heads=2,
            bias=False, num_experts=4, moe_router_topk=2)  # fmt: skip
CASES = {
    "g1-gelu": dict(BASE, granularity=1),
    "g1-swiglu": dict(BASE, activation="swiglu", granularity=1),
    "g2-swiglu": dict(BASE, activation="swiglu", moe_ffn_hidden_size=16, granularity=2),
    "g2-squared-relu-pre-softmax": dict(
        BASE,
        activation="squared_relu",
        moe_router_pre_softmax=True,
        moe_ffn_hidden_size=16,
        granularity=2,
    ),  # fmt: skip
    "g4-8-experts": dict(BASE, num_experts=8, moe_ffn_hidden_size=8, granularity=4),
}


@pytest.fixture(scope="module")
def against_megatron():
    return launch(uw.against_megatron, 1, CASES, timeout=300)[0]


@pytest.mark.parametrize("case", CASES)
def test_megart_upcycles_as_megatron_core(against_megatron, case):
    """Every tensor of the MoE model (experts, routers, and the weights copied as they are)
    equals Megatron-Core's upcycle_state_dict's, bitwise."""
    result = against_megatron[case]
    assert any(".experts.local_experts." in k for k in result["compared"])
    assert result["differ"] == [], result["worst"]


@pytest.mark.parametrize("mistake", uw.MISTAKES)
def test_a_mistaken_upcycling_differs_from_megatron_core(mistake):
    """Slices in the wrong order, or experts made from another layer's MLP, are caught."""
    cases = {k: CASES[k] for k in ("g2-swiglu", "g1-gelu")}
    result = launch(uw.against_megatron, 1, cases, mistake, timeout=300)[0]
    differ = result["g2-swiglu" if mistake == "slices-blocked" else "g1-gelu"]["differ"]
    assert differ and all(".experts." in k for k in differ)


def test_the_upcycled_logits_are_the_dense_ones_where_megatron_makes_them_equal():
    """G = 1 without --moe-router-pre-softmax (top-k weights summing to 1 over identical
    experts), any activation; G = 2 = top-k under --squared-relu (homogeneous: s**3 = G undoes
    the 1/G weights). Not under --moe-router-pre-softmax, nor G = 2 under GeLU (Megatron's
    factors are approximate there)."""
    cases = {
        "g1-gelu": CASES["g1-gelu"],
        "g1-swiglu": CASES["g1-swiglu"],
        "g2-squared-relu": dict(
            BASE, activation="squared_relu", moe_ffn_hidden_size=16, granularity=2
        ),  # fmt: skip
        "g1-pre-softmax": dict(BASE, moe_router_pre_softmax=True, granularity=1),
        "g2-gelu": dict(BASE, moe_ffn_hidden_size=32, granularity=2),
    }
    result = launch(uw.logits_upcycled, 1, cases, timeout=300)[0]
    for name in ("g1-gelu", "g1-swiglu", "g2-squared-relu"):
        worst, scale = result[name]
        assert scale > 0.1 and worst < 1e-12 * scale, name
    for name in ("g1-pre-softmax", "g2-gelu"):
        worst, scale = result[name]
        assert worst > 1e-6 * scale, name


# megart train: a dense checkpoint (one process, iteration 1), upcycled at each layout.
MOE = dict(num_experts=4, disable_bias_linear=True, moe_router_topk=2)
GRANULAR = dict(squared_relu=True, ffn_hidden_size=32)  # the experts' width; dense: 64
LAYOUTS = {  # name: (processes, flags)
    "ep2": (2, dict(expert_model_parallel_size=2)),
    "pp2": (2, dict(pipeline_model_parallel_size=2)),
    "tp2-sp": (2, dict(tensor_model_parallel_size=2, sequence_parallel=True)),
    # The experts' weights are views of one stack per projection: the fill copies into them.
    "grouped-gemm": (1, dict(moe_grouped_gemm=True)),
    "ep2-grouped-gemm": (2, dict(expert_model_parallel_size=2, moe_grouped_gemm=True)),
}


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    """Dense checkpoints at iteration 1, by granularity, and the dense models' loss at
    iteration 1 (a run resumed from them: the first loss an upcycled run reports is on the same
    batch)."""
    out = {}
    for g, flags in ((1, {}), (2, dict(GRANULAR, ffn_hidden_size=64))):
        where = str(tmp_path_factory.mktemp(f"dense{g}"))
        kw = dict(flags, disable_bias_linear=True)
        launch(tw.train_kw, 1, dict(kw, train_iters=1, save=where), timeout=300)
        resumed = launch(tw.train_kw, 1, dict(kw, train_iters=2, load=where), timeout=300)[0]
        out[g] = (where, resumed[0]["loss"])
    return out


def upcycle(dense, tmp_path, g: int, nproc: int = 1, mistake=None, **flags) -> list[dict]:
    where, _ = dense[g]
    kw = dict(MOE, **(GRANULAR if g > 1 else {}), moe_upcycling_granularity=g, train_iters=4,
              moe_use_upcycling=True, load=where, save=str(tmp_path / "moe"), **flags)  # fmt: skip
    return launch(uw.upcycled_run, nproc, kw, mistake, timeout=300)


@pytest.fixture(scope="module")
def one_process(dense, tmp_path_factory):
    """The one-process upcycled runs' histories by granularity, and (``save``) their --save."""
    out = {"save": {}}
    for g in (1, 2):
        where = tmp_path_factory.mktemp(f"one{g}")
        out[g], out["save"][g] = upcycle(dense, where, g)[0], where / "moe"
    return out


@pytest.mark.parametrize("g", [1, 2])
def test_an_upcycled_run_starts_from_the_dense_models_loss(dense, one_process, g):
    """Iteration 1 (the first trained) reports the dense model's loss on its batch; the run
    goes on from iteration 1, as Megatron-LM's."""
    history = one_process[g]
    assert [h["iteration"] for h in history] == [2, 3, 4]
    assert history[0]["loss"] == pytest.approx(dense[g][1], rel=1e-5)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_an_upcycled_run_is_on_the_one_process_curve(dense, one_process, tmp_path, layout):
    nproc, flags = LAYOUTS[layout]
    g = 2 if layout == "tp2-sp" else 1  # tp2 gathers the dense MLP to slice it
    ranks = upcycle(dense, tmp_path, g, nproc, **flags)
    history = ranks[-1]  # the last stage's figures under pp2
    want = [h["loss"] for h in one_process[g]]
    assert [h["loss"] for h in history] == pytest.approx(want, **SAME_RUN)


def test_an_upcycled_run_from_the_wrong_layers_is_off_the_dense_loss(dense, tmp_path):
    """Ten times the tolerance the right run meets (its barely trained layers differ little:
    the mistake moved the loss by 7e-4 relative)."""
    history = upcycle(dense, tmp_path, 1, mistake="experts-of-layer-0")[0]
    assert history[0]["loss"] != pytest.approx(dense[1][1], rel=1e-4)


def test_the_upcycled_model_is_saved_as_iteration_1_without_optimizer(one_process):
    """--save holds iteration 1 (the upcycled weights and random streams, no optimizer state,
    as Megatron-LM saves it) beside the run's last checkpoint."""
    from megart.training.checkpoint import FILE, iteration_dir, latest_iteration, read_file

    where = one_process["save"][1]
    state = read_file(iteration_dir(where, 1) / "mp_rank_00" / FILE)
    assert state["iteration"] == 1 and state["optimizer"] is None and state["rng"] is not None
    assert any(".experts.3." in k for k in state["model"][0])
    assert latest_iteration(where) == 4


@pytest.mark.parametrize(
    ("flags", "names"),
    [
        (dict(moe_use_upcycling=True, load="x", save="y"), "--num-experts"),
        (dict(MOE, moe_use_upcycling=True, load="x"), "--save"),
        (dict(MOE, moe_use_upcycling=True, save="y"), "--load"),
        (
            dict(MOE, moe_use_upcycling=True, load="x", save="y", moe_layer_freq="2"),
            "--moe-layer-freq",
        ),  # fmt: skip
        (
            dict(MOE, moe_use_upcycling=True, load="x", save="y", moe_upcycling_granularity=3),
            "--moe-ffn-hidden-size",
        ),  # fmt: skip
    ],
)
def test_what_upcycling_cannot_do_is_refused_by_name(flags, names):
    with pytest.raises(ConfigError, match=names):
        tw.tiny(**flags).check(1)


def test_upcycling_turns_on_no_load_optim_and_rng_as_megatron():
    config = tw.tiny(**MOE, moe_use_upcycling=True, load="x", save="y")
    config.check(1)
    assert config.no_load_optim and config.no_load_rng
