"""megart train --save --ckpt-format torch: each rank's file in Megatron-LM's legacy layout
(model, optimizer, opt_param_scheduler, rng_state, args, checkpoint_version, iteration), which
--load resumes on the uninterrupted loss curve, as megart's own format does."""

import argparse

import numpy as np
import pytest
import torch

import megatron_optim_workers as mow
import train_workers as tw
from megart.launcher import launch
from megart.training.checkpoint import FILE, iteration_dir, latest_iteration
from train_workers import SAME_RUN

SCENARIOS = {  # name: (processes, flags)
    "tp2-fp32": (2, dict(tensor_model_parallel_size=2)),
    # A low first loss scale, so that both iterations step (2**32 overflows at first).
    # Dropout on: the resumed curve needs the random streams restored.
    "pp2-fp16": (
        2,
        dict(
            pipeline_model_parallel_size=2,
            fp16=True,
            initial_loss_scale=1024,
            hidden_dropout=0.1,
            attention_dropout=0.1,
        ),
    ),
    "bf16": (1, dict(bf16=True)),
    # The distributed optimizer's distrib_optim.pt: two model chunks per rank (a buffer each),
    # data-parallel 2, fp16 (its grad scaler beside the param groups) with
    # --accumulate-allreduce-grads-in-fp32 (megart's way anyway: the file records an fp32
    # gradient buffer), --decoupled-lr (a third param group: the word embedding in the first
    # stage's chunk 0, its tied copy in the last stage's chunk 1).
    "interleaved-dp2-fp16-distributed-optimizer-decoupled-lr": (
        4,
        dict(
            pipeline_model_parallel_size=2,
            num_layers_per_virtual_pipeline_stage=1,
            use_distributed_optimizer=True,
            fp16=True,
            initial_loss_scale=1024,
            decoupled_lr=5e-4,
            decoupled_min_lr=1e-5,
            accumulate_allreduce_grads_in_fp32=True,
        ),
    ),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Per scenario: the uninterrupted 4-iteration curve, the checkpoint after 2 of them in
    Megatron's format (--exit-interval: the saved scheduler is the 4-iteration run's, which the
    resumed run's flags must give), and the curve resumed from it."""
    out = {}
    for name, (nproc, flags) in SCENARIOS.items():
        ckpt = tmp_path_factory.mktemp(name) / "ckpt"
        straight = launch(tw.train_kw, nproc, dict(flags, train_iters=4), timeout=300)[0]
        launch(tw.train_kw, nproc, dict(flags, train_iters=4, exit_interval=2, save=str(ckpt),
                                        ckpt_format="torch"), timeout=300)  # fmt: skip
        resumed = launch(tw.train_kw, nproc, dict(flags, train_iters=4, load=str(ckpt)),
                         timeout=300)[0]  # fmt: skip
        out[name] = straight, ckpt, resumed
    return out


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_load_of_a_torch_format_checkpoint_continues_the_curve(runs, name):
    straight, _, resumed = runs[name]
    assert [h["iteration"] for h in resumed] == [3, 4]
    want = [h["loss"] for h in straight[2:]]
    assert [h["loss"] for h in resumed] == pytest.approx(want, **SAME_RUN)


def _raw(path):
    return torch.load(path, map_location="cpu", weights_only=False)


def test_files_have_megatrons_keys_and_layouts(runs):
    ckpt = runs["pp2-fp16"][1]
    assert latest_iteration(ckpt) == 2
    root = iteration_dir(ckpt, 2)
    assert sorted(p.name for p in root.iterdir()) == ["mp_rank_00_000", "mp_rank_00_001"]
    for stage in range(2):
        state = _raw(root / f"mp_rank_00_{stage:03d}" / FILE)
        assert state["checkpoint_version"] == 3.0 and state["iteration"] == 2
        args = state["args"]
        assert isinstance(args, argparse.Namespace)
        assert (args.pipeline_model_parallel_size, args.tensor_model_parallel_size) == (2, 1)
        assert args.fp16 and args.ckpt_format == "torch" and args.micro_batch_size == 2
        extra = {k for k, v in state["model"].items() if v is None}
        assert extra and all(k.endswith("._extra_state") for k in extra)  # as Megatron-Core's
        model = {k: v for k, v in state["model"].items() if v is not None}
        assert ("embedding.word_embeddings.weight" in model) == (stage == 0)
        assert ("decoder.final_layernorm.weight" in model) == (stage == 1)
        # The tied output layer on the last stage, as Megatron-Core's GPTModel holds it.
        assert ("output_layer.weight" in model) == (stage == 1)
        assert {k.split(".")[2] for k in model if k.startswith("decoder.layers.")} == {"0", "1"}
        assert all(v.dtype == torch.float16 for v in model.values())
        # Float16OptimizerWithFloat16Params: torch's state dict, fp32 masters, grad scaler.
        optimizer = state["optimizer"]
        assert set(optimizer) == {"optimizer", "fp32_from_fp16_params", "grad_scaler"}
        groups = optimizer["optimizer"]["param_groups"]
        masters = optimizer["fp32_from_fp16_params"]
        assert [len(g) for g in masters] == [len(g["params"]) for g in groups]
        # Megatron-Core's default groups (_get_param_groups): decayed parameters, then biases
        # and norms, each in GPTModel's order (the model's keys are in that order too).
        decayed = [n for n, v in model.items() if v.dim() > 1]
        order = decayed + [n for n, v in model.items() if v.dim() == 1]
        assert [len(g) for g in masters] == [len(decayed), len(model) - len(decayed)]
        assert [(g["wd_mult"], g["lr_mult"], g["is_expert_parallel"], g["is_decoupled_lr"],
                 g["weight_decay"]) for g in groups] == [(1.0, 1.0, False, False, 0.01),
                                                         (0.0, 1.0, False, False, 0.0)]  # fmt: skip
        flat = [m for g in masters for m in g]
        assert all(m.dtype == torch.float32 for m in flat)
        assert all(torch.equal(m.half(), model[n]) for m, n in zip(flat, order, strict=True))
        states = optimizer["optimizer"]["state"]
        assert set(states) == set(range(len(flat)))
        assert all({"exp_avg", "exp_avg_sq", "step"} <= set(s) for s in states.values())
        assert all(states[i]["exp_avg"].shape == model[n].shape for i, n in enumerate(order))
        assert set(optimizer["grad_scaler"]) == {"scale", "growth_tracker", "hysteresis_tracker"}
        # No overflow in this run (tests/test_trainer_fp16.py saves one after an overflow): the
        # tracker is --hysteresis, Megatron's default.
        assert optimizer["grad_scaler"]["hysteresis_tracker"] == args.hysteresis == 2
        sched = state["opt_param_scheduler"]
        assert sched["num_steps"] == 2 * 8  # Megatron counts samples: 2 global batches of 8
        assert set(sched) >= {"max_lr", "lr_warmup_steps", "num_steps", "lr_decay_style",
                              "lr_decay_steps", "min_lr", "start_wd", "end_wd"}  # fmt: skip
        (rng,) = state["rng_state"]
        assert set(rng) == {"random_rng_state", "np_rng_state", "torch_rng_state",
                            "cuda_rng_state", "rng_tracker_states"}  # fmt: skip
        assert isinstance(rng["np_rng_state"][1], np.ndarray)
        assert rng["rng_tracker_states"]
    # --bf16: the same layout, without a grad scaler (Megatron's bf16 runs have none).
    state = _raw(iteration_dir(runs["bf16"][1], 2) / "mp_rank_00" / FILE)
    assert set(state["optimizer"]) == {"optimizer", "fp32_from_fp16_params"}
    assert all(v.dtype == torch.bfloat16 for v in state["model"].values() if v is not None)


STYLES = ("linear", "cosine", "constant", "inverse-square-root")


def test_megatrons_scheduler_restored_from_the_state_gives_megarts_rate(runs):
    """Megatron-Core's scheduler loaded from the file (saved after 2 of 4 iterations) and
    from states of longer runs, in warm-up, at its end and past it: its rate for the next step
    is megart's. (--lr-warmup-init is no part of the saved state: the stub's is 0, megart's
    default.)"""
    import train_workers as tw
    from megart.training.megatron_scheduler import scheduler_state

    ckpt = runs["tp2-fp32"][1]
    state = _raw(iteration_dir(ckpt, 2) / "mp_rank_00" / FILE)
    assert set(state["optimizer"]) == {"state", "param_groups"}  # FP32Optimizer: torch's
    cases = [(state["opt_param_scheduler"], tw.tiny(train_iters=4).learning_rate(2))]
    for style in STYLES:
        config = tw.tiny(train_iters=20, lr_warmup_iters=3, lr_decay_style=style)
        cases += [(scheduler_state(config, i), config.learning_rate(i)) for i in (1, 3, 4, 9, 15)]
    got = launch(mow.megatron_rates, 1, [saved for saved, _ in cases], timeout=300)[0]
    assert got == pytest.approx([want for _, want in cases], rel=1e-12)
    assert len({round(w, 12) for _, w in cases}) > 5  # rates that tell styles apart


def test_a_torch_format_checkpoint_reshards_on_load(runs):
    """The tp2 checkpoint resumed by one process: the files read back as megart's, so the
    resharding path takes them (Adam's moments included) and the curve goes on."""
    straight, ckpt, _ = runs["tp2-fp32"]
    resumed = launch(tw.train_kw, 1, dict(train_iters=4, load=str(ckpt)), timeout=300)[0]
    assert [h["iteration"] for h in resumed] == [3, 4]
    want = [h["loss"] for h in straight[2:]]
    assert [h["loss"] for h in resumed] == pytest.approx(want, rel=1e-5, abs=0)


def test_distributed_optimizer_files_hold_a_buffer_per_model_chunk(runs):
    """With --use-distributed-optimizer: distrib_optim.pt beside each rank file, one buffer
    per model chunk under its (param, grad) dtypes (fp16, and fp32 gradients with
    --accumulate-allreduce-grads-in-fp32), and the grad scaler in the rank file
    beside DistributedOptimizer's param groups (three, with --decoupled-lr)."""
    ckpt = runs["interleaved-dp2-fp16-distributed-optimizer-decoupled-lr"][1]
    for stage in range(2):
        rank = iteration_dir(ckpt, 2) / f"mp_rank_00_{stage:03d}"
        state = _raw(rank / FILE)
        assert set(state) >= {"model0", "model1"}
        assert set(state["optimizer"]) == {"optimizer", "grad_scaler"}
        # DistributedOptimizer.state_dict()'s groups carry no parameters; --decoupled-lr's is
        # the middle one, at its own rates.
        groups = state["optimizer"]["optimizer"]["param_groups"]
        lr, floor = state["args"].lr, state["args"].min_lr
        assert [(g["wd_mult"], g["default_config"], g["max_lr"], g["min_lr"]) for g in groups] == [
            (1.0, True, lr, floor), (1.0, False, 5e-4, 1e-5), (0.0, True, lr, floor)
        ]  # fmt: skip
        saved = torch.load(rank / "distrib_optim.pt", weights_only=True)
        assert set(saved) == {"buckets_coalesced", 0, 1}
        assert all(list(saved[c]) == [(torch.float16, torch.float32)] for c in (0, 1))
