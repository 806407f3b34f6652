"""Megatron-LM's Llama 3 example under megart train, and the flags it brought: what megart cannot
honour is refused by name (all at once), --manual-gc, --empty-unused-memory-level and --profile
act at Megatron's points of the loop (its training.py), and the deprecated or inert flags are
accepted without changing the model."""

import argparse
import gzip
import json
import shutil

import pytest
import torch

import housekeeping_workers as hw
import megatron_workers as mw
import train_workers as tw
from megart.cli.train import add_arguments, config_from_args
from megart.errors import ConfigError
from megart.launcher import launch
from megart.training import checkpoint
from megart.training.config import TrainConfig
from megart.training.housekeeping import Housekeeping
from megart.training.megatron_dist import read_common

# Megatron-LM's examples/llama/train_llama3_8b_h100_fp8.sh (August 2026) with DTYPE=bf16 (its
# fp8 lines left out) and mock data, sizes, iterations and intervals shrunk; {ckpt} and {board}
# stand for its checkpoint and TensorBoard paths.
LLAMA3 = """
--use-mcore-models --num-layers 2 --hidden-size 64 --ffn-hidden-size 224
--num-attention-heads 4 --group-query-attention --num-query-groups 2 --kv-channels 16
--seq-length 32 --max-position-embeddings 32 --position-embedding-type rope
--rotary-base 1000000 --rotary-percent 1.0 --attention-dropout 0.0 --hidden-dropout 0.0
--swiglu --normalization RMSNorm --init-method-std 0.0134 --attention-backend fused
--apply-layernorm-1p --untie-embeddings-and-output-weights --disable-bias-linear
--micro-batch-size 1 --global-batch-size 8 --train-samples 48 --lr-decay-samples 40
--lr-warmup-samples 8 --lr 0.00015 --min-lr 0.00001 --decoupled-lr 5.0e-4
--decoupled-min-lr 4.5e-5 --lr-decay-style cosine --clip-grad 1.0 --weight-decay 0.1
--adam-beta1 0.9 --adam-beta2 0.95 --bf16 --grad-reduce-in-bf16 --cross-entropy-loss-fusion
--calculate-per-token-loss --manual-gc --empty-unused-memory-level 1
--exit-duration-in-mins 235 --tensor-model-parallel-size 1 --context-parallel-size 1
--sequence-parallel --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather
--mock-data --tokenizer-type NullTokenizer --vocab-size 1000 --data-cache-path {cache}
--tiktoken-pattern v2 --split 99,1,0 --no-create-attention-mask-in-dataloader
--no-mmap-bin-files --num-workers 1 --log-interval 1 --eval-iters 1 --eval-interval 3
--save-interval 3 --log-throughput --profile --profile-step-start 2 --profile-step-end 4
--ckpt-format torch_dist --distributed-timeout-minutes 60 --save {ckpt} --load {ckpt}
--tensorboard-dir {board}
"""
# The script's default DTYPE=fp8 adds these (where bf16 gives --bf16): megart has no FP8.
LLAMA3_FP8 = (
    "--fp8-format hybrid --fp8-amax-history-len 1024 --fp8-amax-compute-algo max --fp8-param-gather"
)
# What megart cannot do of it: refused together, each by name.
LLAMA3_REFUSED = [flag for flag in LLAMA3_FP8.split() if flag.startswith("--")]


def _llama3(tmp_path, drop=(), replace=None) -> list[str]:
    text = LLAMA3.format(cache=tmp_path / "cache", ckpt=tmp_path / "ckpt", board=tmp_path / "tb")
    for old, new in (replace or {}).items():
        text = text.replace(old, new)
    argv = text.split()
    for flag in drop:  # the flag and its values
        i = argv.index(flag)
        j = i + 1
        while j < len(argv) and not argv[j].startswith("--"):
            j += 1
        del argv[i:j]
    return argv


def test_the_llama3_example_is_refused_naming_what_megart_cannot_do(tmp_path):
    # With bf16 only its --profile (an nsys range) is refused, on a machine without CUDA.
    status, out = mw.run_cli(_llama3(tmp_path))
    if not torch.cuda.is_available():
        assert status == 2 and "iteration" not in out
        assert "--profile without --use-pytorch-profiler" in out, out
    # With fp8 every fp8 flag is refused, in one line.
    status, out = mw.run_cli(_llama3(tmp_path) + LLAMA3_FP8.split())
    assert status == 2 and "iteration" not in out
    for flag in LLAMA3_REFUSED:
        assert f"{flag}: megart" in out, out
    assert out.count("megart train: error") == 1, out  # one line for all of them


def test_the_llama3_example_runs_and_resumes_in_torch_dist(tmp_path):
    """On two data-parallel ranks (zero-centred norm weights, the distributed optimizer with
    both overlaps, gradients reduced in bf16, the embedding and output layer at
    --decoupled-lr), saving Megatron's torch_dist store with the distributed optimizer's
    state, and on this CPU torch's profiler (the script's --profile opens an nsys range, which
    needs a GPU): every other flag as the script gives it."""
    on_cpu = {"--profile ": "--profile --use-pytorch-profiler "}
    argv = _llama3(tmp_path, replace=on_cpu)
    assert "--apply-layernorm-1p" in argv
    results = launch(mw.run_cli, 2, argv, timeout=300)
    status, out = results[0]
    assert [r[0] for r in results] == [0, 0], out
    assert "iteration     6/6 | consumed samples 48 |" in out  # --train-samples 48 / 8
    assert "validation loss at iteration 6" in out
    assert checkpoint.latest_iteration(tmp_path / "ckpt") == 6
    common = read_common(tmp_path / "ckpt" / "iter_0000006")
    assert common["megart"]["model_config"]["apply_layernorm_1p"]
    assert common["optimizer"] == {"param_state_sharding_type": "dp_reshardable"}
    for rank in (0, 1):  # Megatron's place and schedule: steps 2 and 3 active
        trace = json.load(gzip.open(tmp_path / "torch_profile" / f"rank-{rank}.json.gz"))
        steps = {e["name"] for e in trace["traceEvents"] if e.get("name", "").startswith("Prof")}
        assert steps == {"ProfilerStep#2", "ProfilerStep#3"}, steps
    # Resumed from iteration 3's store with the same flags (Megatron's scheduler check
    # refuses another --train-samples for a Megatron format, as Megatron-LM does).
    shutil.rmtree(tmp_path / "ckpt" / "iter_0000006")
    (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").write_text("3\n")
    status, out = launch(mw.run_cli, 2, argv, timeout=300)[0]
    assert status == 0 and "iteration     6/6 | consumed samples 48 |" in out, out
    assert "iteration     3/" not in out


def test_refused_flags_are_named_with_what_to_do():
    status, out = mw.run_cli(["--fp8-format", "hybrid", "--fp8-param-gather", "--num-layers", "2"])
    assert status == 2 and out.count("train with --bf16") == 2, out
    # Partial rotary is rope's (tests/test_rotary_percent.py); without rope it is refused.
    with pytest.raises(ConfigError, match="--rotary-percent 0.5 .*add --position-embedding-type"):
        tw.tiny(rotary_percent=0.5).check(1)
    with pytest.raises(ConfigError, match="--grad-reduce-in-bf16 .*add --bf16"):
        tw.tiny(grad_reduce_in_bf16=True).check(1)
    with pytest.raises(ConfigError, match="--manual-gc-interval -1"):
        tw.tiny(manual_gc_interval=-1).check(1)
    with pytest.raises(ConfigError, match="give 0 <= start < end"):
        tw.tiny(profile=True, use_pytorch_profiler=True, tensorboard_dir="x",
                profile_step_start=3, profile_step_end=3).check(1)  # fmt: skip
    with pytest.raises(ConfigError, match="give --tensorboard-dir"):
        tw.tiny(profile=True, use_pytorch_profiler=True).check(1)
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="needs a CUDA GPU; on CPU add --use-pytorch"):
            tw.tiny(profile=True).check(1)


def test_inert_flags_are_accepted_and_keep_the_model(tmp_path):
    same = tw.tiny(use_mcore_models=True, rotary_percent=1.0, tiktoken_pattern="v2",
                   data_cache_path=str(tmp_path)).gpt_config()  # fmt: skip
    assert same == tw.tiny().gpt_config()
    # megart's gradients are fp32 anyway: the flag changes no bucket, only the record of a
    # Megatron checkpoint (test_megatron_train_ckpt).
    p = argparse.ArgumentParser()
    add_arguments(p)
    config = config_from_args(p.parse_args(["--fp16", "--accumulate-allreduce-grads-in-fp32"]))
    assert config.accumulate_allreduce_grads_in_fp32


def _expected(iters: int, interval: int, level: int, eval_interval: int) -> list[str]:
    """Megatron-LM's points (training.py): --manual-gc collects once before the loop, after
    every interval-th iteration, before each evaluation and (youngest generation) after it;
    --empty-unused-memory-level 1 empties after forward and backward and after each evaluation
    batch, 2 also after the optimizer step. megart evaluates the validation range every
    eval_interval and after the last iteration, then the test range (one batch each)."""
    events = ["gc2"]
    for done in range(1, iters + 1):
        events += ["empty"] * (level >= 1) + ["empty"] * (level >= 2)
        if interval and done % interval == 0:
            events.append("gc2")
        evaluations = (done % eval_interval == 0 or done == iters) + (done == iters)
        events += ["gc2", *["empty"] * (level >= 1), "gc0"] * evaluations
        events.append(f"iteration {done}" + (" eval" if evaluations else ""))
    return events


@pytest.mark.parametrize("interval, level", [(2, 2), (0, 1)])
def test_manual_gc_and_emptying_happen_at_megatrons_points(interval, level):
    kw = dict(manual_gc=True, manual_gc_interval=interval, empty_unused_memory_level=level,
              train_iters=4, eval_iters=1, eval_interval=3)  # fmt: skip
    (run,) = launch(hw.chores, 1, kw, timeout=120)
    assert run["events"] == _expected(4, interval, level, 3)
    assert run["enabled_during"] == [False] * 4 and run["enabled_after"]
    (plain,) = launch(hw.chores, 1, dict(kw, manual_gc=False, empty_unused_memory_level=0))
    assert [e for e in plain["events"] if not e.startswith("iteration")] == []
    assert plain["enabled_during"] == [True] * 4


def test_profile_without_torchs_profiler_brackets_the_steps_for_nsys(monkeypatch):
    """The CUDA profiler range (what nsys --capture-range=cudaProfilerApi records) opens before
    the iteration after --profile-step-start iterations and closes after --profile-step-end,
    on the ranks of --profile-ranks only."""
    calls = []

    class Cudart:
        def cudaProfilerStart(self):  # noqa: N802 (CUDA's name)
            calls.append("start")
            return 0

        def cudaProfilerStop(self):  # noqa: N802
            calls.append("stop")
            return 0

    monkeypatch.setattr(torch.cuda, "cudart", Cudart)
    monkeypatch.setattr(torch.cuda, "check_error", lambda code: None)
    config = TrainConfig(profile=True, profile_step_start=2, profile_step_end=4,
                         profile_ranks=[0, 3])  # fmt: skip
    for rank, want in ((0, ["start", "stop"]), (1, [])):
        calls.clear()
        chores = Housekeeping(config, torch.device("cpu"), rank)
        with chores.running():
            for done in range(6):
                chores.before_iteration(done)
                calls.append(done)
                chores.after_iteration(done + 1)
        assert [c for c in calls if isinstance(c, str)] == want
        if want:  # iterations 3 and 4 (done 2 and 3 before them) inside the range
            assert calls[calls.index("start") + 1 : calls.index("stop")] == [2, 3]
