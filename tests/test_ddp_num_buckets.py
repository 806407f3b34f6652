"""--ddp-num-buckets (and --ddp-bucket-size) as Megatron-LM takes them, against Megatron-Core
0.16.1 itself (one CPU process each, gloo): the bucket size its get_model gives N buckets
(the rank's parameters // N) lays megart's Megatron-format distrib_optim.pt as Megatron-Core's
buffer (hypothesis over models and N) and cuts megart's own gradient buckets where
Megatron-Core's DistributedDataParallel cuts its; both flags together, or N < 1, are refused."""

import pytest
import torch

import ddp_buckets_workers as dbw
import megatron_distopt_workers as mdw
import megatron_workers as mw
import train_workers as tw
from megart.errors import ConfigError
from megart.launcher import launch


def test_saved_layouts_equal_megatron_cores_for_any_number_of_buckets():
    (seen,) = launch(mdw.layouts_agree, 1, 40, True, timeout=300)
    assert seen["examples"] == 40
    assert seen["most_buckets"] >= 3  # numbers that cut the model were drawn


def test_megarts_gradient_buckets_are_megatron_cores():
    counts = [1, 2, 3, 5, 8, 13, 1000, 10**9]  # 10**9: a size of 0, a bucket per parameter
    (seen,) = launch(dbw.live_buckets_agree, 1, counts, 3, timeout=300)
    for case in seen:
        assert case["ours"] == case["theirs"], (case["model"], case["n"])
    for m in {case["model"] for case in seen}:
        buckets = {case["n"]: case["ours"] for case in seen if case["model"] == m}
        assert len(buckets[1]) == 1 and len(buckets[5]) >= 3  # the model cut by the larger N
        assert all(len(b) == 1 for b in buckets[10**9])
        assert len(buckets[None][0]) == 3  # the size held exactly closes the first bucket
    assert any(case["edge"] for case in seen)  # a size rounded down onto a parameter's end


@pytest.mark.parametrize("n", [3, 7])
def test_the_trainers_buckets_take_megatrons_size(n):
    """The Trainer's buckets close once they hold the rank's parameters (Megatron-Core's
    count of the same model) // N elements, not before."""
    (seen,) = launch(dbw.trainer_buckets, 1, dict(ddp_num_buckets=n), timeout=300)
    size = seen["megatron_parameters"] // n
    *full, last = seen["buckets"]
    assert full  # cut
    for b in full:
        assert sum(b) >= size > sum(b[:-1]), (size, b)
    assert size > sum(last[:-1]), (size, last)


@pytest.mark.parametrize(
    "flags, message",
    [
        (dict(ddp_num_buckets=0), "--ddp-num-buckets 0 must be at least 1"),
        (dict(ddp_num_buckets=-2), "--ddp-num-buckets -2 must be at least 1"),
        (dict(ddp_num_buckets=4, ddp_bucket_size=1000), "exclude each other"),
        (dict(ddp_bucket_size=-1), "--ddp-bucket-size -1 must be at least 0"),
    ],
)
def test_bad_bucket_flags_are_refused(flags, message):
    with pytest.raises(ConfigError, match=message):
        tw.tiny(**flags).check(1)


def test_the_command_line_takes_and_refuses_the_flags():
    status, out = mw.run_cli(["--ddp-num-buckets", "0"])
    assert status == 2 and "--ddp-num-buckets 0" in out and "iteration" not in out
    status, out = mw.run_cli(["--ddp-num-buckets", "2", "--ddp-bucket-size", "10"])
    assert status == 2 and "exclude each other" in out


def test_megatron_cores_distributed_optimizer_loads_a_run_with_num_buckets(tmp_path):
    """Interleaved pp2 x dp2 (the rank's parameters over both model chunks divided; bucketed
    only on the first stage's first chunk, which holds the tied embedding's bucket too), fp16
    with a static --loss-scale: Megatron-Core's DistributedDataParallel and
    DistributedOptimizer, with Megatron-LM's bucket size for N, load megart's distrib_optim.pt
    and hold each parameter's fp32 main copy and moments of megart's own checkpoint of the run;
    the file's grad_scaler is the state of Megatron-Core's ConstantGradScaler."""
    from megart.training.checkpoint import FILE, iteration_dir, rank_dir
    from megart.training.megatron_distrib_optim import layouts
    from megart.training.megatron_files import model_chunks

    kw = dict(pipeline_model_parallel_size=2, num_layers_per_virtual_pipeline_stage=1,
              fp16=True, loss_scale=1024.0, ddp_num_buckets=3, use_distributed_optimizer=True,
              train_iters=2)  # fmt: skip
    ref, ours = str(tmp_path / "ref"), str(tmp_path / "megart")
    launch(tw.train_kw, 4, dict(kw, save=ref), timeout=300)
    launch(tw.train_kw, 4, dict(kw, save=ours, ckpt_format="torch"), timeout=300)
    ranks = launch(mdw.load_and_write, 4, kw, ours, ref, None, timeout=300)
    held: dict = {}
    for rank in ranks:
        t, p, d = rank["place"]
        # Megatron's rule: N cut the first stage's first chunk alone; besides, the tied
        # embedding's copies (that chunk's word embedding, the last chunk's output layer) are
        # each a bucket of their own.
        counts = [len(b) for b in rank["buckets"]]
        assert counts[0] > 2 and counts[1] == 1 if p == 0 else counts == [1, 2], rank
        # megart's layout of its file cuts each chunk's buffer where Megatron-Core's does.
        state = torch.load(iteration_dir(ours, 2) / rank_dir(t, p, 2) / FILE, weights_only=False)
        ours_buckets = [x.buckets for x in layouts(model_chunks(state), vars(state["args"]), p)]
        assert ours_buckets == rank["buckets"], (rank["place"], ours_buckets)
        assert rank["scaler_kind"] == "ConstantGradScaler"
        assert rank["file_scaler"] == rank["scaler_state"] == {}
        for param, piece in rank["pieces"].items():
            assert max(piece["diffs"].values()) < 1e-5, (rank["place"], param, piece["diffs"])
            held.setdefault((p, param), []).append((*piece["range"], piece["numel"]))
    for key, pieces in held.items():  # the two data-parallel ranks' pieces tile each parameter
        pieces.sort()
        assert pieces[0][0] == 0 and pieces[-1][1] == pieces[-1][2], (key, pieces)
        assert all(a[1] == b[0] for a, b in zip(pieces, pieces[1:], strict=False)), key
