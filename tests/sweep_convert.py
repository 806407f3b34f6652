"""tests/sweep.py's convert mode: a megart checkpoint converted by megart convert-checkpoint to
Megatron-LM's legacy or torch_dist format, in a drawn tensor/pipeline layout (uneven first or
last stages too), and optionally back to megart's, must fine-tune in another drawn layout as the
original checkpoint does in one process (convert-checkpoint writes weights, which load as
--finetune does)."""

from __future__ import annotations

import random
import tempfile
from pathlib import Path

import train_workers as tw


def _target(rng: random.Random, layers: int) -> dict:
    """convert-checkpoint's target layout: tensor and pipeline sizes (or the source's), and
    uneven first/last stages."""
    target: dict = {}
    if rng.random() < 0.7:
        target.update(tp=rng.choice([1, 2, 4]), pp=rng.choice([1, 2, 3, 4]))
        if target["pp"] > 1 and rng.random() < 0.4:
            end = rng.choice(["first", "last"])
            target[end] = rng.choice([1, 2, 3]) if layers == 8 else 1
    return target


def verdict(rng: random.Random, draw_model, draw_layout, launch, judge, failed) -> str:
    """One drawn case's line (tests/sweep.py's verdicts): ``draw_model(rng)`` gives the model's
    flags, ``draw_layout(rng, layers)`` (ranks, flags, data-parallel size), ``judge`` compares
    loss curves."""
    from megart.cli.convert import convert

    model = draw_model(rng)
    model.pop("recompute_granularity", None)  # the layouts' business, not the weights'
    model.pop("recompute_modules", None)
    micro = rng.choice([1, 2])
    model.update(micro_batch_size=micro, global_batch_size=micro * 2 * 4, train_iters=2)
    fmt = rng.choice(["torch", "torch_dist"])
    target = _target(rng, model["num_layers"])
    back = rng.random() < 0.3  # and back to megart's format
    ranks, layout, _ = draw_layout(rng, model["num_layers"])
    what = f"{model} to {fmt} {target}{' and back' if back else ''}, loaded in {layout}"
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        try:
            launch(tw.train_kw, 1, dict(model, save=str(root / "ckpt")), timeout=300)
            convert("megart", "megatron", str(root / "ckpt"), str(root / "megatron"),
                    target.get("tp"), target.get("pp"), fmt, None, target.get("first"),
                    target.get("last"))  # fmt: skip
            loaded, kind = root / "megatron", fmt
            if back:
                convert("megatron", "megart", str(loaded), str(root / "back"))
                loaded, kind = root / "back", "megart"
            tune = dict(model, load=str(root / "ckpt"), finetune=True)
            straight = launch(tw.train_kw, 1, tune, timeout=300)[0]
            tune = dict(model, **layout, load=str(loaded), ckpt_format=kind)
            histories = launch(tw.train_kw, ranks, tune, timeout=300)
        except Exception as e:  # noqa: BLE001 (every failure is a verdict, printed)
            return failed(e, f"{ranks} ranks {what}")
    return f"{judge(histories, straight, 'convert')} {ranks} ranks {what}"
