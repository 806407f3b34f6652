"""``--ckpt-format torch --use-distributed-optimizer`` against Megatron-Core itself
(megatron-core 0.16.1, CPU): its own DistributedDataParallel and DistributedOptimizer load
megart's distrib_optim.pt and hold, piece by piece over the data-parallel ranks, each
parameter's fp32 main copy and Adam moments as megart's own checkpoint of the same run has them
(mapped by name as the weights are), under pipeline and tensor parallelism, bf16, and an
interleaved fp16 run (a DistributedDataParallel and a buffer per model chunk, the grad scaler's
state as megart's loss scaler); megart resumes its own files and what Megatron-Core's side then
writes (save_parameter_state) on the uninterrupted loss curve, loss scale included; and the
layout of the saved vectors equals Megatron-Core's buffers' for any bucket size
(hypothesis)."""

import shutil
from pathlib import Path

import pytest
import torch

import megatron_distopt_workers as mdw
import train_workers as tw
from megart.errors import ConfigError
from megart.launcher import launch
from megart.training.checkpoint import FILE, iteration_dir, read_file
from train_workers import SAME_RUN

LLAMA = dict(vocab_size=300, normalization="RMSNorm", position_embedding_type="rope",
             swiglu=True, ffn_hidden_size=64, untie_embeddings_and_output_weights=True,
             group_query_attention=True, num_query_groups=2)  # fmt: skip
SCENARIOS = {  # name: (processes, flags); data-parallel 2 in each (with cp2, d x cp 2 x 2)
    # Tied embeddings over two stages: each tied copy in a bucket of its own.
    "gpt2-pp2": (4, dict(pipeline_model_parallel_size=2)),
    "llama-tp2": (4, dict(LLAMA, tensor_model_parallel_size=2)),
    "llama-bf16": (2, dict(LLAMA, bf16=True)),
    # Context parallelism: the distributed optimizer shards over d x cp (4 ranks), rank 0 of
    # them writes the file; Megatron-Core's parallel state at cp2 x dp2 loads and writes it.
    "llama-cp2": (4, dict(LLAMA, context_parallel_size=2)),
    # Interleaved (two model chunks per rank: a DistributedDataParallel and a buffer each, the
    # tied embedding in the first stage's chunk 0 and the last stage's chunk 1) and fp16 (the
    # grad scaler beside the param groups) in one scenario, as launches are what cost here. A
    # low first loss scale, so that both iterations step (2**32 overflows at first), doubled
    # after each step, so that the saved scale is not the one a run starts from.
    "gpt2-interleaved-fp16": (4, dict(pipeline_model_parallel_size=2,
                                      num_layers_per_virtual_pipeline_stage=1, fp16=True,
                                      initial_loss_scale=1024, loss_scale_window=1)),
}  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Per scenario: megart's uninterrupted 4 iterations (saving its own format after 2, the
    reference), its checkpoint after 2 in Megatron's format, Megatron-Core's load of it (and
    the checkpoint it writes), and megart resumed from both."""
    out = {}
    for name, (nproc, flags) in SCENARIOS.items():
        tmp = tmp_path_factory.mktemp(name)
        kw = dict(flags, train_iters=4, use_distributed_optimizer=True)
        ref, ours, theirs = (str(tmp / d) for d in ("ref", "megart", "megatron"))
        straight = launch(tw.train_kw, nproc, dict(kw, save=ref, save_interval=2), timeout=300)[0]
        launch(tw.train_kw, nproc, dict(kw, save=ours, save_interval=2, exit_interval=2,
                                   ckpt_format="torch"), timeout=300)  # fmt: skip
        megatron = launch(mdw.load_and_write, nproc, kw, ours, ref, theirs, timeout=300)
        resumed = {
            d: launch(tw.train_kw, nproc, dict(kw, load=d), timeout=300)[0] for d in (ours, theirs)
        }
        out[name] = dict(straight=straight, megatron=megatron, ours=ours, theirs=theirs,
                         resumed_ours=resumed[ours], resumed_theirs=resumed[theirs])  # fmt: skip
    return out


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_megatron_core_holds_megarts_state_after_loading_distrib_optim(runs, name):
    pieces = _pieces(runs[name])
    for key, held in pieces.items():  # the pieces tile every parameter
        held.sort()
        assert held[0][0] == 0 and held[-1][1] == held[-1][2], (key, held)
        assert all(a[1] == b[0] for a, b in zip(held, held[1:], strict=False)), (key, held)


def test_megatron_core_holds_both_model_chunks_and_megarts_loss_scale(runs):
    """Interleaved: each rank's two model chunks hold pieces (checked above, chunk by chunk);
    --fp16: Megatron-Core's DynamicGradScaler holds the scale, overflow-free steps and
    hysteresis tracker of megart's own checkpoint; without it, there is no grad scaler."""
    r = runs["gpt2-interleaved-fp16"]
    assert {(p, c) for _, p, (c, _) in _pieces(r)} == {(p, c) for p in (0, 1) for c in (0, 1)}
    for rank in r["megatron"]:
        assert rank["chunks"] == 2
        assert rank["scaler"] == rank["loss_scaler"], rank
        assert rank["scaler"][0] > 1024, rank  # grown: not the scale a run starts from
    assert all(rank["scaler"] is None for rank in runs["llama-bf16"]["megatron"])


def test_some_parameter_is_cut_between_the_data_parallel_ranks(runs):
    """The scatter and gather cut a parameter where a rank's part of a bucket ends."""
    cut = [
        n for r in runs.values() for n, held in _pieces(r).items() if len({h[3] for h in held}) == 2
    ]
    assert cut


def _pieces(run: dict) -> dict:
    """(tp, pp, (model chunk, parameter)) -> (start, end, elements, data-parallel rank) of
    each piece held, each checked against megart's own checkpoint."""
    pieces: dict = {}
    for rank in run["megatron"]:
        t, p, d = rank["place"]
        assert rank["pieces"], f"data-parallel rank {d} holds no optimizer state"
        for param, piece in rank["pieces"].items():
            assert max(piece["diffs"].values()) < 1e-5, (rank["place"], param, piece["diffs"])
            pieces.setdefault((t, p, param), []).append((*piece["range"], piece["numel"], d))
    return pieces


@pytest.mark.parametrize("name", list(SCENARIOS))
@pytest.mark.parametrize("written_by", ["ours", "theirs"])
def test_megart_resumes_distrib_optim_on_the_curve(runs, name, written_by):
    r = runs[name]
    resumed = r[f"resumed_{written_by}"]
    assert [h["iteration"] for h in resumed] == [3, 4]
    want = [h["loss"] for h in r["straight"][2:]]
    assert [h["loss"] for h in resumed] == pytest.approx(want, **SAME_RUN)
    # --fp16: the loss scale resumed too (the curve barely feels it while nothing overflows).
    assert [h["loss_scale"] for h in resumed] == [h["loss_scale"] for h in r["straight"][2:]]


def test_files_are_the_distributed_optimizers(runs):
    """The rank file's optimizer is DistributedOptimizer.state_dict()'s (no parameter state,
    each group with its step), distrib_optim.pt get_parameter_state_dp_zero()'s."""
    for name, key in (("llama-tp2", (torch.float32,) * 2),
                      ("llama-bf16", (torch.bfloat16, torch.float32))):  # fmt: skip
        root = iteration_dir(runs[name]["ours"], 2) / "mp_rank_00"
        state = torch.load(root / FILE, weights_only=False)
        assert set(state["optimizer"]) == {"optimizer"}
        groups = state["optimizer"]["optimizer"]["param_groups"]
        assert [g["wd_mult"] for g in groups] == [1.0, 0.0]
        assert all("params" not in g and g["step"] == 2 for g in groups)
        assert state["args"].use_distributed_optimizer and state["args"].data_parallel_size == 2
        saved = torch.load(root / mdw.DISTRIB, weights_only=True)
        assert set(saved) == {"buckets_coalesced", 0} and saved["buckets_coalesced"]
        (vectors,) = saved[0].values()
        assert list(saved[0]) == [key]
        n = vectors["numel_unpadded"]
        assert all(vectors[k].shape == (n,) and vectors[k].dtype == torch.float32
                   for k in ("param", "exp_avg", "exp_avg_sq"))  # fmt: skip


def test_the_buffers_dtypes_are_megatron_cores():
    """distrib_optim.pt keys each buffer's vectors by (parameter dtype, gradient dtype): megart
    writes the ones Megatron-Core's DistributedDataParallel gives the run's precision flags."""
    from megart.training.megatron_distrib_optim import dtype_key

    runs = [{}, dict(bf16=True), dict(bf16=True, grad_reduce_in_bf16=True), dict(fp16=True),
            dict(fp16=True, accumulate_allreduce_grads_in_fp32=True)]  # fmt: skip
    (theirs,) = launch(mdw.buffer_dtypes, 1, runs, timeout=300)
    assert theirs == [[dtype_key(args)] for args in runs]


def test_layouts_equal_megatron_cores_for_any_bucket_size():
    (seen,) = launch(mdw.layouts_agree, 1, 40, timeout=300)
    assert seen["examples"] == 40
    assert seen["most_buckets"] >= 3  # bucket limits that cut the model were drawn


def test_a_distrib_optim_checkpoint_reshards_on_load(runs):
    """Megatron-Core's tp2 x dp2 checkpoint resumed by one process without the distributed
    optimizer: read as megart's files (distrib_optim.pt joined), the resharding path takes it,
    Adam's moments included."""
    r = runs["llama-tp2"]
    kw = dict(LLAMA, train_iters=4, load=r["theirs"])
    resumed = launch(tw.train_kw, 1, kw, timeout=300)[0]
    want = [h["loss"] for h in r["straight"][2:]]
    assert [h["loss"] for h in resumed] == pytest.approx(want, rel=1e-5, abs=0)


def _copy(runs, tmp_path) -> Path:
    root = tmp_path / "ckpt"
    shutil.copytree(runs["llama-bf16"]["ours"], root)
    rank = iteration_dir(root, 2) / "mp_rank_00"
    for sums in rank.glob("*.sha256"):  # edited below: load them unchecked
        sums.unlink()
    return rank


def test_what_megart_cannot_read_of_a_distrib_optim_checkpoint_is_refused(runs, tmp_path):
    rank = _copy(runs, tmp_path)
    state = torch.load(rank / FILE, weights_only=False)
    (rank / mdw.DISTRIB).rename(rank / "elsewhere.pt")
    with pytest.raises(ConfigError, match="distrib_optim.pt .*is missing.*--no-load-optim"):
        read_file(rank / FILE)
    torch.save({0: {"per bucket": []}}, rank / mdw.DISTRIB)  # Megatron's layout before 2024
    with pytest.raises(ConfigError, match="from before 2024.*legacy-dist-opt-format"):
        read_file(rank / FILE)
    saved = torch.load(rank / "elsewhere.pt", weights_only=True)
    (vectors,) = saved[0].values()
    vectors["numel_unpadded"] += 64  # a buffer of another layout
    torch.save(saved, rank / mdw.DISTRIB)
    with pytest.raises(ConfigError, match="buffer holds .* elements where .* take"):
        read_file(rank / FILE)
    # --ddp-num-buckets files are read (tests/test_ddp_num_buckets.py); one whose args hold
    # both bucket flags, which Megatron-LM refuses to run with, is refused by name.
    state["args"].ddp_num_buckets, state["args"].ddp_bucket_size = 4, 1000
    torch.save(state, rank / FILE)
    with pytest.raises(ConfigError, match="--ddp-num-buckets 4 and --ddp-bucket-size 1000"):
        read_file(rank / FILE)
