"""Random sweeps of megart train on CPU ranks, longer than the suite runs: every combination
megart train accepts must follow the one-process loss curve. A bug hunt, not a test: it prints
one line per combination (OK with the largest relative difference, MISMATCH, REFUSED with
megart's one-line reason, or ERROR) and exits 1 if any combination mismatched or failed.

    python tests/sweep.py curves --seed 7 --count 40     # layouts x model variants x flags
    python tests/sweep.py precision --seed 31 --count 40 # the same under bf16/fp16 flags
    python tests/sweep.py resume --seed 17 --count 40    # save in one layout, resume in another
    python tests/sweep.py resume-moe --seed 5 --count 20 # the same, always with experts
    python tests/sweep.py deepseek --seed 3 --count 20   # MLA, YaRN, MTP, sinks, cp, resume
    python tests/sweep.py memory --seed 23 --count 40    # megart plan's memory against ranks
    python tests/sweep.py hf --seed 5 --count 40         # export-hf and import-hf (sweep_hf)
    python tests/sweep.py convert --seed 9 --count 40    # convert-checkpoint (sweep_convert)
    python tests/sweep.py hf-import --seed 3 --count 40  # transformers' models (sweep_hf)
    python tests/sweep.py mcore --seed 1 --count 40      # Megatron-Core's GPTModel (sweep_mcore)
    python tests/sweep.py mcore-tp2 --seed 11 --count 40 # its tp2 model on converted files
    python tests/sweep.py mcore-pp2 --seed 21 --count 30 # its pp2 stages (sweep_mcore_pp)

A layout is up to 4 ranks of tensor, pipeline (1f1b, interleaved, zb-h1, zb-v, uneven
stages), context (p2p, all_gather, a2a) and data parallelism (distributed optimizer, overlapped
reduction); a model variant mixes SwiGLU, grouped queries, rope, RMSNorm, untied output,
no biases, --qk-layernorm, a sliding window, recomputation and the fused loss (memory: the
small GPTs of test_plan_memory; hf: a model of a Hugging Face family, see sweep_hf; convert:
checkpoints through convert-checkpoint, see sweep_convert; resume-moe: resume with a
mixture-of-experts model always, expert parallelism drawn more often, grouped GEMM and the
router's input jitter at times; deepseek: curves with multi-latent attention, YaRN and
multi-token prediction and attention sinks drawn, context parallelism half the time, and
resumes through Megatron-LM's formats, see sweep_deepseek). On
2026-11-29 these sweeps found six bugs (git log: "found by a random ... sweep"). REFUSED
lines are expected (layouts a batch or layer count does not allow); read them for unclear
messages.
"""

from __future__ import annotations

import argparse
import math
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import sweep_deepseek  # noqa: E402
import train_workers as tw  # noqa: E402
from megart import ConfigError  # noqa: E402
from megart.launcher import launch  # noqa: E402
from megart.training.lr import WSD_DECAY_STYLES  # noqa: E402

# How far a run may stray from the one-process curve: fp32 layouts reorder sums only; 16-bit
# runs round differently per layout (up to 6.1e-5 over 76 accepted combinations, 2026-11-29).
# memory: megart plan's saved activations against what real ranks hold (relative; parameter,
# gradient and optimizer bytes must be equal), test_plan_memory's bound.
# hf: the curve of an imported export in another layout (its logits: sweep_hf.LOGITS).
# convert: the fine-tuning curve of a converted checkpoint.
# hf-import: the first loss of an imported transformers model against transformers' own.
# mcore: float64 logits of megart's GPT and Megatron-Core's GPTModel, weights mapped either way;
# mcore-tp2: of Megatron-Core's tp2 model loading the tp2 checkpoint megart converts to;
# mcore-pp2: of its pipeline stages (plain, interleaved, uneven) on pp2 converted files.
# deepseek: the curves' bound (its draws add MLA, YaRN, MTP, sinks: sweep_deepseek).
TOLERANCE = {"curves": 1e-5, "precision": 2e-2, "resume": 1e-5, "resume-moe": 1e-5,
             "deepseek": 1e-5,
             "memory": 1e-2, "hf": 1e-5,
             "convert": 1e-5, "hf-import": 1e-5, "mcore": 1e-10, "mcore-tp2": 1e-10,
             "mcore-pp2": 1e-10}  # fmt: skip


def _model(rng: random.Random, moe: bool = False) -> dict:
    """A drawn model variant's flags; with ``moe`` always a mixture of experts."""
    model: dict = dict(num_layers=rng.choice([4, 8]))
    for flag, chance in (("swiglu", 0.5), ("position_embedding_type", 0.5),
                         ("untie_embeddings_and_output_weights", 0.3),
                         ("disable_bias_linear", 0.3), ("qk_layernorm", 0.2)):  # fmt: skip
        if rng.random() < chance:
            model[flag] = "rope" if flag == "position_embedding_type" else True
    if "swiglu" not in model and rng.random() < 0.2:
        model["squared_relu"] = True
    if rng.random() < 0.4:
        model.update(group_query_attention=True, num_query_groups=2)
    if rng.random() < 0.3:
        model["normalization"] = "RMSNorm"
    if rng.random() < 0.15:
        model["window_size"] = rng.choice(["5,0", "3,0"])
        if rng.random() < 0.4:
            model["window_attn_skip_freq"] = "2"
    if rng.random() < 0.2:
        model["vocab_size"] = 300  # padded to the tensor-parallel multiple
    if rng.random() < 0.15:
        model["kv_channels"] = rng.choice([4, 16])  # heads other than h / heads = 8 wide
    recompute = rng.choice([None, None, "full", "selective"])
    if recompute:
        model["recompute_granularity"] = recompute
    if recompute == "selective" and rng.random() < 0.6:  # Megatron's --recompute-modules
        model["recompute_modules"] = _modules(rng)
    if rng.random() < 0.3:
        model["cross_entropy_loss_fusion"] = True
    if rng.random() < 0.15:  # Megatron's rising weight decay, set on every rank each step
        model.update(weight_decay_incr_style=rng.choice(["linear", "cosine"]),
                     start_weight_decay=0.0, end_weight_decay=0.5)  # fmt: skip
    if moe or rng.random() < 0.2:  # mixture of experts (tp only with sequence parallelism)
        model.update(_experts(rng, model["num_layers"], moe), disable_bias_linear=True)
    if rng.random() < 0.15:  # WSD: its anneal over the run's last iterations
        model.update(lr_decay_style="WSD", lr_wsd_decay_iters=rng.choice([2, 3]),
                     lr_wsd_decay_style=rng.choice(WSD_DECAY_STYLES))  # fmt: skip
    return model


def _experts(rng: random.Random, layers: int, more: bool = False) -> dict:
    """Mixture-of-experts flags for ``layers`` layers: experts, top-k, routing, which layers
    and the two losses; with ``more`` at times grouped GEMM and the router's input jitter."""
    experts = rng.choice([2, 3, 4])
    flags: dict = dict(num_experts=experts, moe_router_topk=rng.randint(1, min(3, experts)),
                       moe_aux_loss_coeff=rng.choice([0.0, 0.01, 0.1]))  # fmt: skip
    if flags["moe_router_topk"] == 1 or rng.random() < 0.3:
        flags["moe_router_pre_softmax"] = True
    pattern = rng.choice(["2", f"([0]+[1]*3)*{layers // 4}"])
    for flag, value, chance in (("moe_layer_freq", pattern, 0.3),
                                ("moe_ffn_hidden_size", 48, 0.3), ("moe_z_loss_coeff", 0.01, 0.3),
                                ("moe_router_score_function", "sigmoid", 0.15),
                                ("moe_shared_expert_intermediate_size", 24, 0.2)):  # fmt: skip
        if rng.random() < chance:
            flags[flag] = value
    for flag, value in (("moe_grouped_gemm", True), ("moe_input_jitter_eps", 0.1)):
        if more and rng.random() < 0.4:
            flags[flag] = value
    return flags


def _modules(rng: random.Random) -> list[str]:
    """Some of the modules --recompute-modules takes, in a drawn order."""
    return rng.sample(["core_attn", "layernorm", "mlp", "moe", "shared_experts"], rng.randint(1, 3))


def _precision(rng: random.Random) -> dict:
    kind = rng.choice(["bf16", "bf16", "fp16"])
    flags: dict = {kind: True}
    if kind == "fp16":
        flags["initial_loss_scale"] = 1024
    elif rng.random() < 0.5:
        flags["half_weights"] = True
    if kind == "bf16" and rng.random() < 0.3:
        flags["grad_reduce_in_bf16"] = True
    if rng.random() < 0.3:
        flags["fp32_residual_connection"] = True
    return flags


def _schedule(rng: random.Random, flags: dict) -> str:
    """Draws a pipeline schedule into ``flags``; its name."""
    schedule = rng.choice(["1f1b", "interleaved", "zb-h1", "zb-v"])
    if schedule == "interleaved":
        flags["num_layers_per_virtual_pipeline_stage"] = 1
    elif schedule != "1f1b":
        flags["pipeline_schedule"] = schedule
    return schedule


def _layout(rng: random.Random, layers: int, distopt: float = 0.5) -> tuple[int, dict, int]:
    """(ranks, layout flags, data-parallel size); ``distopt``: the chance of the distributed
    optimizer where there is data parallelism."""
    tp, pp, cp, dp = (rng.choice(c) for c in ([1, 2], [1, 2, 2, 4], [1, 1, 2], [1, 2]))
    while tp * pp * cp * dp > 4:
        dp, cp = 1, cp if tp * pp * cp <= 4 else 1
        tp = tp if tp * pp <= 4 else 1
    flags: dict = dict(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                       context_parallel_size=cp)  # fmt: skip
    if cp > 1:
        flags["cp_comm_type"] = rng.choice(["p2p", "all_gather", "a2a"])
    if tp > 1 and rng.random() < 0.6:
        flags["sequence_parallel"] = True
    if pp > 1 and _schedule(rng, flags) == "1f1b" and layers == 8 and rng.random() < 0.5:
        flags["decoder_first_pipeline_num_layers"] = 1 if pp == 4 else 3
    if dp > 1:
        for flag, chance in (("use_distributed_optimizer", distopt), ("overlap_grad_reduce", 0.5)):
            if rng.random() < chance:
                flags[flag] = True
    return tp * pp * cp * dp, flags, dp


def draw(rng: random.Random, mode: str) -> tuple[int, dict, dict]:
    """(ranks, the flags one process shares, the layout's flags)."""
    model = _model(rng, moe=mode == "resume-moe")
    if mode == "precision":
        model.update(_precision(rng))
    if mode == "deepseek":
        sweep_deepseek.parts(rng, model)
    if mode == "deepseek":  # context parallelism drawn more often
        ranks, layout, dp = sweep_deepseek.layout(rng, _layout, model["num_layers"])
    else:  # resume-moe: the experts' own optimizer shards (and their files) drawn more often
        ranks, layout, dp = _layout(rng, model["num_layers"], 0.8 if mode == "resume-moe" else 0.5)
    _spread_experts(rng, model, layout, dp, 0.8 if mode == "resume-moe" else 0.5)
    if mode == "resume-moe" and layout["tensor_model_parallel_size"] > 1:
        layout["sequence_parallel"] = True  # experts under tp need it (else refused)
    micro = rng.choice([1, 2])
    rounds = rng.choice([2, 4, 8]) if layout["pipeline_model_parallel_size"] > 1 else 2
    model.update(micro_batch_size=micro, global_batch_size=micro * dp * rounds)
    return ranks, model, layout


def _spread_experts(
    rng: random.Random, model: dict, layout: dict, dp: int, chance: float = 0.5
) -> None:
    """At times, expert parallelism over the data- and context-parallel ranks, where
    ``model``'s experts split over them (into ``layout``; any other draw's taken out)."""
    layout.pop("expert_model_parallel_size", None)
    experts = model.get("num_experts") or 1
    spread = dp * layout.get("context_parallel_size", 1)  # EP over dp x cp, at any tp
    if spread > 1 and experts % spread == 0 and rng.random() < chance:
        layout["expert_model_parallel_size"] = spread


def _train(kw: dict) -> list[dict]:
    return tw.train(**kw)


def _failed(error: Exception, what: str) -> str:
    """The verdict line of a run that raised: REFUSED (megart's ConfigError, raised here or in
    a rank) or ERROR, with its one-line reason."""
    lines = [line for line in str(error).splitlines() if "Error:" in line]
    reason = lines[-1] if lines else str(error)[-400:]
    refused = isinstance(error, ConfigError) or "ConfigError" in str(error)
    return f"{'REFUSED' if refused else 'ERROR'} {what}: {reason}"


def _memory_case(rng: random.Random) -> tuple[int, dict]:
    """(ranks, flags) of one of test_plan_memory's small GPTs on a drawn layout."""
    from plan_memory_check import LLAMA, LLAMA_ROPE, SMALL

    model = dict(rng.choice([SMALL, LLAMA, LLAMA_ROPE]))
    if rng.random() < 0.2:
        model["kv_channels"] = rng.choice([8, 32])  # heads other than h / heads = 16 wide
    tp, pp, dp = rng.choice([1, 2]), rng.choice([1, 2]), rng.choice([1, 2])
    cp = 2 if tp * pp * dp <= 2 and rng.random() < 0.3 else 1
    flags: dict = dict(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                       context_parallel_size=cp)  # fmt: skip
    if tp > 1 and rng.random() < 0.5:
        flags["sequence_parallel"] = True
    if pp > 1:
        _schedule(rng, flags)
    recompute = rng.choice([None, None, None, "selective", "full"])
    if recompute:
        flags["recompute_granularity"] = recompute
    if recompute == "selective" and rng.random() < 0.6:
        flags["recompute_modules"] = _modules(rng)
    if dp > 1 and rng.random() < 0.5:
        flags["use_distributed_optimizer"] = True
    if "bf16" not in model and rng.random() < 0.4:
        flags["bf16"] = True
    if model.get("bf16") or flags.get("bf16"):
        for flag, chance in (("half_weights", 0.3), ("fp32_residual_connection", 0.3)):
            if rng.random() < chance:
                flags[flag] = True
    if rng.random() < 0.2:
        flags["cross_entropy_loss_fusion"] = True
    # Tokens per microbatch unlike any weight's dimension (plan_workers.SavedBytes' rule).
    micro = rng.choice([3, 5]) if model["hidden_size"] == 64 else rng.choice([1, 3])
    rounds = rng.choice([2, 4]) if pp > 1 else rng.choice([1, 2])
    flags.update(micro_batch_size=micro, global_batch_size=micro * dp * rounds)
    return tp * pp * dp * cp, {**model, **flags}


def memory_verdict(rng: random.Random) -> str:
    """megart plan's memory against real ranks for one drawn case (test_plan_memory's check)."""
    from plan_memory_check import predicted_and_held

    ranks, kw = _memory_case(rng)
    try:
        rows = predicted_and_held(ranks, kw)
    except Exception as e:  # noqa: BLE001 (every failure is a verdict, printed)
        return _failed(e, f"{ranks} ranks {kw}")
    worst = 0.0
    for held, want, cpu in rows:
        for part in ("parameters", "gradients", "optimizer"):
            if want[part] != held[part]:
                return f"MISMATCH {part} {want[part]} planned, {held[part]} held {kw}"
        worst = max(worst, abs(held["saved_peak"] / (want["saved"] + cpu) - 1))
    verdict = "OK" if worst < TOLERANCE["memory"] else "MISMATCH"
    return f"{verdict} {worst:.1e} (saved) {ranks} ranks {kw}"


def one(rng: random.Random, mode: str) -> str:
    """Runs one drawn combination; its verdict line."""
    if mode == "memory":
        return memory_verdict(rng)
    if mode == "hf":
        import sweep_hf

        return sweep_hf.verdict(rng, _layout, launch, judge, _failed)
    if mode == "hf-import":
        import sweep_hf

        return sweep_hf.import_verdict(rng, _layout, launch, _failed)
    if mode == "convert":
        import sweep_convert

        return sweep_convert.verdict(rng, _model, _layout, launch, judge, _failed)
    if mode == "mcore":
        import sweep_mcore

        return sweep_mcore.verdict(rng, launch, _failed, TOLERANCE["mcore"])
    if mode == "mcore-tp2":
        import sweep_mcore_tp

        return sweep_mcore_tp.verdict(rng, launch, _failed, TOLERANCE["mcore-tp2"])
    if mode == "mcore-pp2":
        import sweep_mcore_pp

        return sweep_mcore_pp.verdict(rng, launch, _failed, TOLERANCE["mcore-pp2"])
    ranks, base, layout = draw(rng, mode)
    resume, formats = mode in ("resume", "resume-moe"), ("megart", "torch", "torch_dist")
    if mode == "deepseek" and sweep_deepseek.resumes(rng, base):  # through Megatron's formats
        resume, formats = True, sweep_deepseek.FORMATS
        ranks = sweep_deepseek.one_stage(base, layout, ranks)
    base["train_iters"] = 4 if resume else 2
    store = tempfile.mkdtemp() if resume else None
    try:
        straight = launch(_train, 1, base, timeout=300)[0]
        flags = layout
        if store is not None:
            fmt = rng.choice(formats)
            save = dict(base, **layout, exit_interval=2, save=store, save_interval=2)
            launch(_train, ranks, dict(save, ckpt_format=fmt), timeout=300)
            saved = {k: v for k, v in layout.items() if v not in (1, None)}
            ranks, _, flags = draw(rng, mode)  # another layout of the same run
            if mode == "deepseek":
                ranks = sweep_deepseek.one_stage(base, flags, ranks)
            sizes = ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                     "context_parallel_size")  # fmt: skip
            dp = ranks // math.prod(flags[k] for k in sizes)
            _spread_experts(rng, base, flags, dp, 0.8 if mode == "resume-moe" else 0.5)
            flags.update(load=store, ckpt_format=fmt)
            if fmt != "megart" and rng.random() < 0.4:
                # Another schedule on the command line, the saved one taken instead: the curve
                # must be the uninterrupted run's all the same.
                flags.update(use_checkpoint_opt_param_scheduler=True, lr=5e-3, min_lr=0.0,
                             lr_decay_style="cosine", weight_decay=0.3)  # fmt: skip
            layout = dict(flags, saved_in=saved)  # what the verdict line shows
            straight = straight[2:]
        histories = launch(_train, ranks, {**base, **flags}, timeout=300)
    except Exception as e:  # noqa: BLE001 (every failure is a verdict, printed)
        return _failed(e, f"{ranks} ranks {layout} {base}")
    finally:
        if store is not None:
            shutil.rmtree(store, ignore_errors=True)
    return f"{judge(histories, straight, mode)} {ranks} ranks {layout} {base}"


def judge(histories: list[list[dict]], straight: list[dict], mode: str) -> str:
    """OK or MISMATCH, with the largest relative loss difference of any rank's history from
    the one-process run's, against ``mode``'s tolerance."""
    worst = max(
        abs(h["loss"] - r["loss"]) / abs(r["loss"])
        for history in histories
        for h, r in zip(history, straight, strict=True)
    )
    return f"{'OK' if worst < TOLERANCE[mode] else 'MISMATCH'} {worst:.1e}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=sorted(TOLERANCE))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--count", type=int, default=20)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    bad = 0
    for i in range(args.count):
        start = time.time()
        line = one(rng, args.mode)
        bad += line.startswith(("MISMATCH", "ERROR"))
        print(f"[{i}] {time.time() - start:.0f}s {line}", flush=True)
    print(f"{args.count} combinations, {bad} mismatched or failed")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
