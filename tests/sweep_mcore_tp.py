"""tests/sweep.py's mcore-tp2 mode: a model drawn as the mcore mode draws it (sweep_mcore), its
weights drawn and written as megart's release checkpoint, converted by megart
convert-checkpoint's code to Megatron-LM's legacy format split over two tensor-parallel ranks,
and loaded by Megatron-Core's GPTModel built with tensor parallelism 2 on two launched
processes from that checkpoint's args alone (megatron_core_workers.tp_rank_logits): its
logits, gathered over the vocabulary shards, must be megart's one-process logits (float64 both
sides). What this adds to the mcore mode: the fused q/k/v, MLP and vocabulary split over ranks
as Megatron-Core splits them, and every model option carried by the args megart writes."""

from __future__ import annotations

import random
import tempfile
from collections.abc import Callable
from pathlib import Path

from megart import ConfigError
from megart.models import GPTConfig
from megart.training.ckpt_files import iteration_dir, rank_dir

TP = 2


def config(rng: random.Random) -> dict:
    """sweep_mcore.config's model, redrawn until its heads and query groups split over TP."""
    import sweep_mcore

    for _ in range(100):
        kw = sweep_mcore.config(rng)
        heads = kw["num_attention_heads"]
        if heads % TP == 0 and kw.get("num_query_groups", heads) % TP == 0:
            return kw
    raise RuntimeError("no model whose heads split over two ranks in 100 draws")


def write_and_logits(kw: dict, directory: str, layout: dict | None = None) -> dict:
    """In a launched process: megart's GPT of ``kw``, weights drawn (megatron_core_workers'
    noise), written to ``directory``/release and converted to Megatron's legacy files in
    ``directory``/megatron (``layout``: megart_to_megatron's keywords, by default tp2); its
    float64 logits of some tokens."""
    import torch

    import megatron_core_workers as mcw
    from megart.models import GPT
    from megart.training.checkpoint_save import write_release
    from megart.training.megatron_checkpoint import megart_to_megatron

    cfg = GPTConfig(**kw)
    model = mcw.drawn(GPT(cfg))
    weights = {k: v.detach().clone() for k, v in model.chunk.state_dict().items()}
    write_release(f"{directory}/release", cfg, weights, list(range(cfg.num_layers)))
    layout = dict(tp=TP, pp=1) if layout is None else layout
    megart_to_megatron(f"{directory}/release", f"{directory}/megatron", **layout)
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length),
                           generator=torch.Generator().manual_seed(3))  # fmt: skip
    with torch.no_grad():
        logits = model.double()(tokens)
    return dict(tokens=tokens, logits=logits)


def check(kw: dict, launch, failed, tolerance: float, swap_ranks: bool = False) -> str:
    """The verdict line of one model (tests/sweep.py's verdicts, see converted_verdict) on tp2
    files. ``swap_ranks`` (for the test that the check catches a wrong split): each rank is
    given the other's file."""
    import megatron_core_workers as mcw

    def swap(megatron_dir: Path) -> None:
        root = iteration_dir(megatron_dir, 0)
        files = [root / rank_dir(r, 0, 1) for r in range(TP)]
        files[0].rename(f"{files[0]}.swap")
        files[1].rename(files[0])
        Path(f"{files[0]}.swap").rename(files[1])

    layout = dict(tp=TP, pp=1)
    alter = swap if swap_ranks else None
    return converted_verdict(kw, str(kw), layout, mcw.tp_rank_logits, TP, launch, failed,
                             tolerance, alter)  # fmt: skip


def converted_verdict(
    kw: dict,
    what: str,
    layout: dict,
    worker: Callable,
    ranks: int,
    launch,
    failed,
    tolerance: float,
    alter: Callable[[Path], None] | None = None,
) -> str:
    """The verdict line of model ``kw`` converted to Megatron's legacy files of ``layout``
    (write_and_logits) and run by ``worker`` on ``ranks`` launched processes (given the files'
    directory and the tokens; its logits, or None on a rank that has none): REFUSED where
    megart refuses it (GPTConfig, or the conversion), ERROR where Megatron-Core or a process
    fails, else OK or MISMATCH by the largest logit difference against ``tolerance`` (judged).
    ``alter``: called on the files' directory before the worker runs (a test's sabotage)."""
    try:
        GPTConfig(**kw)
    except ConfigError as e:
        return f"REFUSED {what}: {e}"
    with tempfile.TemporaryDirectory() as tmp:
        try:
            ours = launch(write_and_logits, 1, kw, tmp, layout, timeout=300)[0]
            if alter is not None:
                alter(Path(tmp, "megatron"))
            got = launch(worker, ranks, f"{tmp}/megatron", ours["tokens"], timeout=300)
        except Exception as e:  # noqa: BLE001 (every failure is a verdict, printed)
            return failed(e, what)
    gots = [g for g in got if g is not None]
    if not gots:
        return f"ERROR no rank returned logits: {what}"
    return judged(ours["logits"], gots, what, tolerance)


def judged(want, gots: list, what: str, tolerance: float) -> str:  # noqa: ANN001 (tensors)
    """OK or MISMATCH by the largest difference of the logits ``gots`` (vocabulary padding
    cut) from megart's ``want`` against ``tolerance``; ERROR where the logits are too small
    for the bound to say much."""
    worst = max((got[..., : want.shape[-1]] - want).abs().max().item() for got in gots)
    scale = want.abs().max().item()
    numbers = f"{worst:.1e} (largest logit {scale:.2g})"
    if scale < 0.1:
        return f"ERROR logits too small to judge: {numbers} {what}"
    return f"{'OK' if worst < tolerance else 'MISMATCH'} {numbers} {what}"


def verdict(rng: random.Random, launch, failed, tolerance: float) -> str:
    """One drawn model's line; SKIP where megatron-core is not installed."""
    import sweep_mcore

    return sweep_mcore.skipped() or check(config(rng), launch, failed, tolerance)
