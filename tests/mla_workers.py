"""Launched workers of test_mla.py: Megatron-Core's MLA model beside megart's, with a mistake
planted in megart's layer, and at tensor-parallel size 2 from megart's own weights."""

from __future__ import annotations

import torch

import megatron_core_workers as mcw
from megart.models import GPT, GPTConfig
from megart.models.megatron_names import to_megatron
from megart.models.mla import MLA
from megart.models.rope import apply_rotary
from megart.models.vocab import fit_vocab
from megart.training.shards import partition_dims


def compare_with_halves_rope(kw: dict) -> float:
    """mcw.compare's forward difference of ``kw``'s model with a mistake planted in megart's
    MLA: rope turning the halves of the rope channels instead of adjacent pairs."""
    real = MLA._rotated
    MLA._rotated = lambda self, x, rope: apply_rotary(x, *rope, interleaved=False)
    try:
        return mcw.compare(kw, draw=True)["forward"]
    finally:
        MLA._rotated = real


def tp_logits(cfg: GPTConfig, state: dict[str, torch.Tensor], tokens: torch.Tensor) -> torch.Tensor:
    """On each of the launched ranks: Megatron-Core's GPTModel with MLA at tensor-parallel
    size 2 (the world's), loading strictly this rank's slices of megart's whole ``state``
    (split as megart's resharder splits them: by each weight's partition_dim); the logits of
    ``tokens``, gathered over the vocabulary shards."""
    import os

    from megatron.core import parallel_state

    tp, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    torch.distributed.init_process_group("gloo")
    parallel_state.initialize_model_parallel(tp, 1)
    mcw.on_cpu_only()
    model = mcw.megatron_model(cfg, tp)
    dims = partition_dims(cfg, tuple(range(cfg.num_layers)), True, True)
    mine = {}
    for name, whole in state.items():
        if name in ("wte.weight", "output_layer.weight"):  # the vocabulary padded for tp
            whole = fit_vocab(whole, cfg.padded_vocab_size(tp))
        dim = dims[name]
        mine[name] = whole if dim is None else whole.chunk(tp, dim)[rank]
    extra = {k: v for k, v in model.state_dict().items() if k.endswith("_extra_state")}
    model.load_state_dict({**to_megatron(mine, cfg), **extra}, strict=True)
    local = mcw.megatron_logits(model.eval(), tokens).contiguous()
    parts = [torch.empty_like(local) for _ in range(tp)]
    torch.distributed.all_gather(parts, local)
    torch.distributed.destroy_process_group()
    return torch.cat(parts, -1)


def megart_model(kw: dict) -> tuple[GPTConfig, dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    """A float64 megart GPT of ``kw`` with noise on its weights: its config, whole state
    (names without the chunk's prefix), tokens and logits."""
    cfg = GPTConfig(**kw)
    model = mcw.drawn(GPT(cfg).double())
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length),
                           generator=torch.Generator().manual_seed(3))  # fmt: skip
    with torch.no_grad():
        logits = model(tokens)
    return cfg, model.chunk.state_dict(), tokens, logits


def gradients(kw: dict) -> dict[str, torch.Tensor]:
    """Every gradient after one iteration of ``kw``'s run, gathered whole (train_workers')."""
    import train_workers as tw

    return tw.gradients_after_one_step(**kw)
