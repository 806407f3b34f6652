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


def write_and_logits(kw: dict, directory: str) -> dict:
    """In a launched process: megart's GPT of ``kw``, weights drawn (megatron_core_workers'
    noise), written to ``directory``/release and converted to Megatron's tp2 legacy files in
    ``directory``/megatron; its float64 logits of some tokens."""
    import torch

    import megatron_core_workers as mcw
    from megart.models import GPT
    from megart.training.checkpoint_save import write_release
    from megart.training.megatron_checkpoint import megart_to_megatron

    cfg = GPTConfig(**kw)
    model = mcw.drawn(GPT(cfg))
    weights = {k: v.detach().clone() for k, v in model.chunk.state_dict().items()}
    write_release(f"{directory}/release", cfg, weights, list(range(cfg.num_layers)))
    megart_to_megatron(f"{directory}/release", f"{directory}/megatron", TP, 1)
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length),
                           generator=torch.Generator().manual_seed(3))  # fmt: skip
    with torch.no_grad():
        logits = model.double()(tokens)
    return dict(tokens=tokens, logits=logits)


def check(kw: dict, launch, failed, tolerance: float, swap_ranks: bool = False) -> str:
    """The verdict line of one model (tests/sweep.py's verdicts): REFUSED where megart refuses
    it (GPTConfig, or the conversion to two ranks), ERROR where Megatron-Core or a process
    fails, else OK or MISMATCH by the largest logit difference against ``tolerance``.
    ``swap_ranks`` (for the test that the check catches a wrong split): each rank is given
    the other's file."""
    import megatron_core_workers as mcw

    try:
        GPTConfig(**kw)
    except ConfigError as e:
        return f"REFUSED {kw}: {e}"
    with tempfile.TemporaryDirectory() as tmp:
        try:
            ours = launch(write_and_logits, 1, kw, tmp, timeout=300)[0]
        except Exception as e:  # noqa: BLE001 (every failure is a verdict, printed)
            return failed(e, str(kw))
        if swap_ranks:
            root = iteration_dir(Path(tmp, "megatron"), 0)
            files = [root / rank_dir(r, 0, 1) for r in range(TP)]
            files[0].rename(f"{files[0]}.swap")
            files[1].rename(files[0])
            Path(f"{files[0]}.swap").rename(files[1])
        try:
            ranks = launch(mcw.tp_rank_logits, TP, f"{tmp}/megatron", ours["tokens"],
                           timeout=300)  # fmt: skip
        except Exception as e:  # noqa: BLE001
            return failed(e, str(kw))
    want = ours["logits"]
    worst = max((got[..., : want.shape[-1]] - want).abs().max().item() for got in ranks)
    scale = want.abs().max().item()
    numbers = f"{worst:.1e} (largest logit {scale:.2g})"
    if scale < 0.1:
        return f"ERROR logits too small to judge: {numbers} {kw}"
    return f"{'OK' if worst < tolerance else 'MISMATCH'} {numbers} {kw}"


def verdict(rng: random.Random, launch, failed, tolerance: float) -> str:
    """One drawn model's line; SKIP where megatron-core is not installed."""
    import sweep_mcore

    return sweep_mcore.skipped() or check(config(rng), launch, failed, tolerance)
