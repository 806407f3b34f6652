"""megart's runs with DeepSeek-V3's router options (tests/test_moe_router_balance.py compares
them with Megatron-Core's): dp2, tp2 with sequence parallelism, pp2, cp2, ep2 and full
recomputation end with the one-process run's expert biases, losses and logged sequence loss,
and the global loss's runs follow theirs; a checkpoint in each of megart's formats resumes on
the curve with its biases, at another layout, and Megatron-Core loads the Megatron-LM formats'
biases (and megart its store's). Each comparison catches a mistake made on purpose."""

import pytest
import torch

import moe_router_workers as rw
from megart.launcher import launch
from megart.models import GPTConfig
from test_moe_router_balance import BASE, BIAS, GLOBAL, TRAIN
from train_workers import SAME_RUN

TP2 = dict(tensor_model_parallel_size=2, sequence_parallel=True)
# name: (processes, flags, train_bias's mistake or None, the rank whose figures to read)
RUNS = {
    "dp2": (2, TRAIN, None, 0),
    "tp2-sp": (2, dict(TRAIN, **TP2), None, 0),
    "pp2": (2, dict(TRAIN, pipeline_model_parallel_size=2), None, -1),
    "cp2": (2, dict(TRAIN, context_parallel_size=2), None, 0),
    "ep2": (2, dict(TRAIN, expert_model_parallel_size=2), None, 0),
    "recompute-full": (1, dict(TRAIN, recompute_granularity="full"), None, 0),
    # The mistakes this exists to catch.
    "dp2-counts-unsummed": (2, TRAIN, "counts-unsummed", 0),
    "tp2-sp-counts-unsummed": (2, dict(TRAIN, **TP2), "counts-unsummed", 0),
    "cp2-counts-over-tp-only": (2, dict(TRAIN, context_parallel_size=2), "counts-over-tp-only", 0),
    "tp2-sp-seq-counts-local": (2, dict(TRAIN, **TP2), "seq-counts-local", 0),
    "cp2-seq-counts-local": (2, dict(TRAIN, context_parallel_size=2), "seq-counts-local", 0),
}


@pytest.fixture(scope="module")
def one_process():
    return launch(rw.train_bias, 1, TRAIN, timeout=300)[0]


@pytest.fixture(scope="module")
def runs():
    return {
        name: launch(rw.train_bias, n, kw, mistake, timeout=300)[rank]
        for name, (n, kw, mistake, rank) in RUNS.items()
    }


@pytest.mark.parametrize("name", [n for n, c in RUNS.items() if c[2] is None])
def test_every_layout_ends_with_the_one_process_expert_biases(one_process, runs, name):
    """The counts are summed over the tensor-, data- and context-parallel ranks (and the
    stages' layers gathered for the figure), the sequence loss's counts over t x cp: the
    one-process biases exactly, its loss curve and its logged sequence loss."""
    want, got = one_process, runs[name]
    assert (want["bias"] != 0).sum() > 8  # of 4 layers x 4 experts
    assert torch.equal(got["bias"], want["bias"])
    assert [h["loss"] for h in got["history"]] == pytest.approx(
        [h["loss"] for h in want["history"]], **SAME_RUN
    )
    logged = [h["seq_load_balancing_loss"] for h in want["history"]]
    assert 0.5 < logged[0] < 5
    assert [h["seq_load_balancing_loss"] for h in got["history"]] == pytest.approx(
        logged, **SAME_RUN
    )
    assert "load_balancing_loss" not in got["history"][0]


@pytest.mark.parametrize("name", [n for n, c in RUNS.items() if "counts-unsummed" in n
                                  or "over-tp-only" in n])  # fmt: skip
def test_the_biases_catch_counts_not_summed_over_the_ranks(one_process, runs, name):
    assert not torch.equal(runs[name]["bias"], one_process["bias"])


@pytest.mark.parametrize("name", [n for n in RUNS if "seq-counts-local" in n])
def test_the_logged_sequence_loss_catches_counts_not_summed_over_the_ranks(one_process, runs, name):
    want = [h["seq_load_balancing_loss"] for h in one_process["history"]]
    got = [h["seq_load_balancing_loss"] for h in runs[name]["history"]]
    assert got != pytest.approx(want, rel=1e-3)


@pytest.mark.parametrize("fmt", ["megart", "torch", "torch_dist"])
def test_a_checkpoint_resumes_on_the_curve_with_its_expert_biases(tmp_path, one_process, fmt):
    """Saved at pp2 after 2 iterations (megart's files hold every layer's bias, Megatron-LM's
    legacy files each stage's under Megatron-Core's name too, its torch_dist store each layer's
    slice of Megatron-Core's key), resumed in one process:
    iterations 3 and 4 are the one-process run's, and so are its final biases; not so where
    the biases are not loaded (the run goes on from zeros)."""
    store = str(tmp_path / "ckpt")
    saving = dict(TRAIN, pipeline_model_parallel_size=2, exit_interval=2, save=store,
                  ckpt_format=fmt)  # fmt: skip
    launch(rw.train_bias, 2, saving, timeout=300)
    resumed = launch(rw.train_bias, 1, dict(TRAIN, load=store), timeout=300)[0]
    assert [h["iteration"] for h in resumed["history"]] == [3, 4]
    want = [h["loss"] for h in one_process["history"][2:]]
    assert [h["loss"] for h in resumed["history"]] == pytest.approx(want, **SAME_RUN)
    assert torch.equal(resumed["bias"], one_process["bias"])
    lost = launch(rw.train_bias, 1, dict(TRAIN, load=store), "bias-not-loaded", timeout=300)[0]
    assert not torch.equal(lost["bias"], one_process["bias"])


def test_megatron_core_loads_the_legacy_file_with_its_expert_biases(tmp_path):
    """megart train's --ckpt-format torch file (one rank): Megatron-Core's GPTModel loads it
    strictly, its routers' expert_bias buffers are megart's biases, and it gives the logits
    of megart's GPT with the checkpoint's weights and biases. megart's reader of Megatron-LM's
    checkpoints gives them under Megatron-Core's names, and convert-checkpoint --to megatron
    carries them (tests/test_megatron_expert_bias_files: Megatron-LM's own files)."""
    from megart.cli.main import main
    from megart.training import checkpoint
    from megart.training.megatron_checkpoint import read_megatron
    from megart.training.megatron_files import torch_load

    store = str(tmp_path / "ckpt")
    launch(rw.train_bias, 1, dict(TRAIN, train_iters=2, save=store, ckpt_format="torch"),
           timeout=300)  # fmt: skip
    r = launch(rw.legacy_file_in_megatron_core, 1, store, timeout=300)[0]
    assert r["same_bias"] and r["nonzero"] > 4
    assert r["diff"] < 1e-6
    root = checkpoint.iteration_dir(store, checkpoint.latest_iteration(store))
    rows = torch_load(root / "mp_rank_00" / checkpoint.FILE)["megart"]["expert_bias"]
    out = str(tmp_path / "converted")
    argv = ["convert-checkpoint", "--load", store, "--save", out, "--from", "megart",
            "--to", "megatron"]  # fmt: skip
    assert main(argv) == 0
    for d in (store, out):
        cfg, model, _ = read_megatron(d)
        for i in range(cfg.num_layers):
            assert torch.equal(model[f"decoder.layers.{i}.mlp.router.expert_bias"], rows[i]), d


def test_megatron_core_loads_the_torch_dist_store_with_its_expert_biases(tmp_path):
    """megart train's --ckpt-format torch_dist store: Megatron-Core's GPTModel loads it
    strictly (its expert_bias key included) with megart's biases."""
    store = str(tmp_path / "dist")
    saved = launch(rw.train_bias, 1, dict(TRAIN, train_iters=2, save=store,
                   ckpt_format="torch_dist"), timeout=300)[0]  # fmt: skip
    loaded = launch(rw.store_biases_in_megatron_core, 1, store, timeout=300)[0]
    assert (saved["bias"] != 0).sum() > 4 and torch.equal(loaded, saved["bias"])


@pytest.mark.parametrize("freq", [1, 2])
def test_megart_reads_megatron_cores_store_of_expert_biases(tmp_path, freq):
    """Megatron-Core's own torch_dist save (its biases drawn at random): megart's load puts
    each layer's row into its router, with every layer under one key (--moe-layer-freq 1) or
    each its own (a mix of dense and MoE layers)."""
    from megart.models import GPT
    from megart.models.moe_router import biased_routers
    from megart.training.checkpoint import iteration_dir
    from megart.training.megatron_dist_train_load import load_expert_bias

    kw = {**BASE, **BIAS, "num_layers": 4, "moe_layer_freq": freq}
    want = launch(rw.megatron_core_store_with_biases, 1, kw, str(tmp_path), timeout=300)[0]
    ours = GPT(GPTConfig(**kw))
    load_expert_bias(iteration_dir(tmp_path, 3), [ours.chunk], 0)
    got = torch.stack([r.expert_bias for r in biased_routers([ours.chunk])])
    assert got.shape == want.shape and torch.equal(got, want)


GLOBAL_TRAIN = dict(num_experts=4, disable_bias_linear=True, **GLOBAL, train_iters=4)
ONE_BATCH = dict(micro_batch_size=2, global_batch_size=4)  # per data-parallel rank: one
# name: (processes, flags, train_bias's mistake or None, the rank whose figures to read)
GLOBAL_RUNS = {
    "dp2": (2, dict(GLOBAL_TRAIN, **ONE_BATCH), None, 0),
    "tp2-sp": (2, dict(GLOBAL_TRAIN, **TP2), None, 0),
    "cp2": (2, dict(GLOBAL_TRAIN, context_parallel_size=2), None, 0),
    "pp2": (2, dict(GLOBAL_TRAIN, pipeline_model_parallel_size=2), None, -1),
    # The mistake this exists to catch: the counts of each data-parallel rank alone.
    "dp2-counts-local": (2, dict(GLOBAL_TRAIN, **ONE_BATCH), "global-counts-local", 0),
}


@pytest.fixture(scope="module")
def global_runs():
    """The runs, and two one-process ones: of GLOBAL_TRAIN, and of dp2's global batch as one
    microbatch at half the coefficient (each dp2 rank's loss is its half of the batch's, and
    dp2 averages the ranks' gradients: half the one-process batch's)."""
    runs = {
        name: launch(rw.train_bias, n, kw, mistake, timeout=300)[rank]
        for name, (n, kw, mistake, rank) in GLOBAL_RUNS.items()
    }
    runs["one"] = launch(rw.train_bias, 1, GLOBAL_TRAIN, timeout=300)[0]
    half = dict(GLOBAL_TRAIN, micro_batch_size=4, global_batch_size=4, moe_aux_loss_coeff=0.05)
    runs["one-batch"] = launch(rw.train_bias, 1, half, timeout=300)[0]
    return runs


def _figures(run: dict, name: str) -> list[float]:
    return [h[name] for h in run["history"]]


@pytest.mark.parametrize("name", [n for n, c in GLOBAL_RUNS.items() if c[2] is None])
def test_global_aux_loss_runs_follow_the_one_process_curve(global_runs, name):
    """The counts are summed over the tensor-, data- and context-parallel ranks and averaged
    over the iteration's microbatches so far: tp2 with sequence parallelism, cp2 and pp2 are
    the one-process run, dp2 its global batch in one microbatch at half the coefficient; the
    logged global_load_balancing_loss (the ranks' shares summed) too."""
    want = global_runs["one-batch" if name == "dp2" else "one"]
    got = global_runs[name]
    assert _figures(got, "loss") == pytest.approx(_figures(want, "loss"), **SAME_RUN)
    logged = _figures(want, "global_load_balancing_loss")
    assert 0.5 < logged[0] < 5
    assert _figures(got, "global_load_balancing_loss") == pytest.approx(logged, **SAME_RUN)


def test_the_global_curve_catches_counts_of_one_data_parallel_rank(global_runs):
    want = _figures(global_runs["one-batch"], "global_load_balancing_loss")
    got = _figures(global_runs["dp2-counts-local"], "global_load_balancing_loss")
    assert got != pytest.approx(want, rel=1e-3)
