"""tests/sweep.py's mcore-pp2 mode: a model drawn as the mcore mode draws it (sweep_mcore), with
2 to 9 layers, its weights drawn and written as megart's release checkpoint, converted by
megart convert-checkpoint's code (megart_to_megatron) to Megatron-LM's legacy files for a drawn
layout of two pipeline ranks: plain, interleaved (two model chunks a rank, ``model0``/
``model1``) or with uneven first/last stages (interleaved too, now and then). Each of two
launched processes builds Megatron-Core's GPTModel chunks of its pipeline rank from its file's
args alone, as Megatron-LM would (stage_logits), strictly loads its file, and the forward runs
stage by stage in Megatron's virtual-stage order (stage s is chunk c of rank r, s = c p + r),
the hidden states sent between the processes; the last stage's logits must be megart's
one-process logits (float64 both sides). What this adds to the mcore-tp2 mode: which layers
each rank's chunks hold (Megatron-Core's layer offsets, interleaved and uneven), where the
embeddings, final norm and (tied: copied) output layer go, and windows and rope on later
stages."""

from __future__ import annotations

import random
from pathlib import Path

import torch

from megart.training.ckpt_files import FILE, iteration_dir, latest_iteration, rank_dir

PP = 2
# Sabotages (for the test that the check catches misplaced layers): the decoder layers of two
# (pipeline rank, chunk) places exchanged in the files, their other tensors left. "ranks":
# under plain pp2, each rank holds the other's layers. "v": under interleaving, the two ranks'
# second chunks (stages 2 and 3) trade layers, which is zb-v's V placement (rank r holding
# stages r and 2p - 1 - r) written as Megatron's files. "chunks": rank 1's two chunks trade.
SABOTAGES = {"ranks": ((0, 0), (1, 0)), "v": ((0, 1), (1, 1)), "chunks": ((1, 0), (1, 1))}


def config(rng: random.Random, layers: int) -> dict:
    """sweep_mcore.config's model with ``layers`` layers (a per-layer window or MoE pattern
    redrawn for them)."""
    import sweep_mcore

    kw = sweep_mcore.config(rng)
    kw["num_layers"] = layers
    for name in ("window_attn_skip_freq", "moe_layer_freq"):
        if isinstance(kw.get(name), tuple):
            kw[name] = tuple(rng.choice([0, 1]) for _ in range(layers))
    return kw


def layout(rng: random.Random) -> tuple[int, dict]:
    """A drawn layer count (2 to 9) and megart_to_megatron's keywords of a layout of PP
    pipeline ranks for it: plain, interleaved (vpp 2) or uneven first/last stages (first,
    last or both given; interleaved now and then). One draw in ten gets a layer more, which
    megart's converter mostly refuses (its reasons, read in the REFUSED lines)."""
    kind = rng.choice(["plain", "interleaved", "uneven", "uneven"])
    vpp = 2 if kind == "interleaved" or (kind == "uneven" and rng.random() < 0.4) else 1
    out: dict = dict(tp=1, pp=PP) | ({"vpp": vpp} if vpp > 1 else {})
    if kind == "uneven":  # the first or last rank's layers, the other's the rest
        layers = rng.choice(range(2 * vpp, 9, vpp))
        n = rng.choice(range(vpp, layers, vpp))
        end = rng.choice(["first", "last"] + ["both"] * (vpp == 1))  # no middle: no vpp
        out.update(dict(first=n, last=layers - n) if end == "both" else {end: n})
    else:
        layers = rng.choice(range(PP * vpp, 9, PP * vpp))
    return layers + (rng.random() < 0.1), out


def described(layout: dict) -> str:
    """The layout's part of a verdict line: pp2 [vpp2] [first=F] [last=L]."""
    parts = [f"pp{layout['pp']}"] + [f"{k}={layout[k]}" for k in ("vpp", "first", "last")
                                     if k in layout]  # fmt: skip
    return " ".join(parts)


def virtual_stages(a: dict) -> int | None:
    """The model chunks per pipeline rank Megatron-LM's arguments derive from args
    (``vars``): --num-virtual-stages-per-pipeline-rank, else pp-stage layers over
    --num-layers-per-virtual-pipeline-stage; None without interleaving."""
    per = a.get("num_layers_per_virtual_pipeline_stage")
    vpp = a.get("num_virtual_stages_per_pipeline_rank")
    if vpp is None and per is not None:
        vpp = a["num_layers"] // a["pipeline_model_parallel_size"] // per
    return None if vpp == 1 else vpp


def stage_logits(megatron_dir: str, tokens: torch.Tensor) -> torch.Tensor | None:
    """On each launched rank (a pipeline rank; the world's size is the pipeline size):
    Megatron-Core's GPTModel chunks of this rank, built from its file's args (interleaving and
    uneven stages as Megatron-LM derives them), each strictly loading its file's ``model`` or
    ``model<c>``; the forward of ``tokens`` run stage by stage over the ranks. The logits on
    the rank of the last stage, None on the others."""
    import os

    from megatron.core import parallel_state

    import megatron_core_workers as mcw
    from megart.training.megatron_args import config_from_args, saved_stages
    from megart.training.megatron_checkpoint import read_rank
    from megart.training.megatron_files import model_chunks

    pp, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    torch.distributed.init_process_group("gloo")
    root = iteration_dir(megatron_dir, latest_iteration(megatron_dir))
    state = read_rank(root / rank_dir(0, rank, pp) / FILE)
    a = vars(state["args"])
    assert a["pipeline_model_parallel_size"] == pp, a["pipeline_model_parallel_size"]
    vpp = virtual_stages(a)
    parallel_state.initialize_model_parallel(1, pp, vpp)
    mcw.on_cpu_only()
    cfg = config_from_args(a)
    chunks = model_chunks(state)
    assert len(chunks) == (vpp or 1), f"{len(chunks)} chunks in the file, args say {vpp}"
    models = []
    for c, saved in enumerate(chunks):
        model = mcw.megatron_model(cfg, 1, pp, None if vpp is None else c, **saved_stages(a))
        model.load_state_dict(saved, strict=True)
        models.append(model)
    out = run_stages(models, tokens, cfg.hidden_size, pp, rank)
    torch.distributed.destroy_process_group()
    return out


def run_stages(
    models: list[torch.nn.Module], tokens: torch.Tensor, hidden: int, pp: int, rank: int
) -> torch.Tensor | None:
    """This rank's part of the forward of ``tokens`` through all pp x chunks virtual stages in
    Megatron's order (stage s: chunk s // pp of rank s % pp): each stage after the first takes
    the hidden states ([s, b, h], float64) the previous one's rank sends. The last stage's
    output (logits) where this rank holds it, else None."""
    import megatron_core_workers as mcw

    stages = pp * len(models)
    out = None
    for stage in range(stages):
        chunk, owner = divmod(stage, pp)
        if owner != rank:
            continue
        model = models[chunk]
        if stage > 0:
            x = torch.empty(tokens.shape[1], tokens.shape[0], hidden, dtype=torch.float64)
            torch.distributed.recv(x, src=(stage - 1) % pp)
            model.set_input_tensor(x)
        out = mcw.megatron_logits(model, tokens)
        if stage < stages - 1:
            torch.distributed.send(out.contiguous(), dst=(stage + 1) % pp)
    return out if (stages - 1) % pp == rank else None


def sabotage_files(megatron_dir: Path, places: tuple[tuple[int, int], ...]) -> None:
    """Exchanges the decoder layers of the two (pipeline rank, chunk) ``places`` in the legacy
    files of ``megatron_dir`` (which must hold equally many there), the rest left."""
    from megart.training.megatron_files import model_chunks, torch_load

    root = iteration_dir(megatron_dir, latest_iteration(megatron_dir))
    paths = {p: root / rank_dir(0, p, PP) / FILE for p in {p for p, _ in places}}
    states = {p: torch_load(path) for p, path in paths.items()}
    (p, c), (q, d) = places
    one, other = model_chunks(states[p])[c], model_chunks(states[q])[d]
    layers = [k for k in one if k.startswith("decoder.layers.")]
    assert sorted(layers) == sorted(k for k in other if k.startswith("decoder.layers.")), places
    for k in layers:
        one[k], other[k] = other[k], one[k]
    for p, path in paths.items():
        torch.save(states[p], path)


def check(
    kw: dict, layout: dict, launch, failed, tolerance: float, sabotage: str | None = None
) -> str:
    """The verdict line of one model and layout (tests/sweep.py's verdicts, see
    sweep_mcore_tp.converted_verdict), the last stage's logits judged. ``sabotage``: a
    SABOTAGES key."""
    import sweep_mcore_tp

    def alter(megatron_dir: Path) -> None:
        sabotage_files(megatron_dir, SABOTAGES[sabotage])

    import sweep_mcore

    what = f"{described(layout)} {kw}"
    bound = sweep_mcore.tolerance_for(kw, tolerance)  # a model with experts: fp32 routing
    return sweep_mcore_tp.converted_verdict(kw, what, layout, stage_logits, PP, launch, failed,
                                            bound, alter if sabotage else None)  # fmt: skip


def verdict(rng: random.Random, launch, failed, tolerance: float) -> str:
    """One drawn model's line, in a drawn layout; SKIP where megatron-core is not installed."""
    import sweep_mcore

    if skipped := sweep_mcore.skipped():
        return skipped
    layers, drawn = layout(rng)
    return check(config(rng, layers), drawn, launch, failed, tolerance)
