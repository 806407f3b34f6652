"""megart's checkpoints next to Megatron-Core's GPTModel (megatron_core_workers builds it): the
one-process GPT of a megart checkpoint (any layout and format) and its logits, and the
round trip megart -> Megatron-LM legacy checkpoint (loaded strictly by Megatron-Core) -> megart.
Run in launched processes, as megatron_core_workers."""

from __future__ import annotations

import torch

from megart.models import GPT
from megatron_core_workers import megatron_logits, megatron_model


def checkpoint_gpt(megart_dir: str) -> tuple[GPT, dict[str, torch.Tensor]]:
    """megart's one-process GPT (float64) of the latest checkpoint in ``megart_dir`` (any
    layout, any of megart's formats), and its whole weights (one chunk's names, the vocabulary
    padded for one rank)."""
    from megart.models.vocab import fit_vocab
    from megart.training import checkpoint
    from megart.training.shards import read_shards, whole_tensors

    root = checkpoint.iteration_dir(megart_dir, checkpoint.latest_iteration(megart_dir))
    shards = read_shards(root)
    cfg = checkpoint.model_config(shards[0, 0])
    whole = {k.removeprefix("chunk."): v for k, v in whole_tensors(shards, cfg).items()}
    rows = cfg.padded_vocab_size(1)
    for name in ("wte.weight", "output_layer.weight"):
        if name in whole:
            whole[name] = fit_vocab(whole[name], rows)
    ours = GPT(cfg)
    ours.chunk.load_state_dict(whole, strict=True)
    return ours.double(), whole


def checkpoint_logits(megart_dir: str, tokens: torch.Tensor) -> torch.Tensor:
    """checkpoint_gpt's float64 logits of ``tokens``."""
    with torch.no_grad():
        return checkpoint_gpt(megart_dir)[0](tokens)


def legacy_checkpoint_roundtrip(megart_dir: str, out_dir: str) -> dict:
    """megart checkpoint -> Megatron-LM legacy checkpoint (loaded strictly by Megatron-Core's
    GPTModel, logits compared with megart's GPT of the checkpoint's weights) -> megart release
    checkpoint (weights compared with the original)."""
    from pathlib import Path

    from megart.cli.main import main
    from megart.training import checkpoint
    from megart.training.megatron_checkpoint import read_megatron

    ours, whole = checkpoint_gpt(megart_dir)
    cfg = ours.cfg

    megatron_dir, back_dir = Path(out_dir) / "megatron", Path(out_dir) / "back"
    convert = ["convert-checkpoint", "--load"]
    assert main([*convert, megart_dir, "--save", str(megatron_dir), "--from", "megart",
                 "--to", "megatron"]) == 0  # fmt: skip
    read_cfg, model, iteration = read_megatron(megatron_dir)
    theirs = megatron_model(read_cfg)
    extra = {k: v for k, v in theirs.state_dict().items() if k.endswith("_extra_state")}
    theirs.load_state_dict({**model, **extra}, strict=True)
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length),
                           generator=torch.Generator().manual_seed(5))  # fmt: skip
    with torch.no_grad():
        want = ours(tokens)
    got = megatron_logits(theirs, tokens)[..., : want.shape[-1]]

    assert main([*convert, str(megatron_dir), "--save", str(back_dir), "--from", "megatron",
                 "--to", "megart"]) == 0  # fmt: skip
    state = checkpoint.read_file(checkpoint.iteration_dir(back_dir, 0) / "mp_rank_00" /
                                 checkpoint.FILE)  # fmt: skip
    same = all(torch.equal(state["model"][0][k], v) for k, v in whole.items())
    return dict(
        logits=(got - want).abs().max().item(),
        same_weights=same and set(state["model"][0]) == set(whole),
        same_config=checkpoint.model_config(state) == cfg,
        iteration=iteration,
    )
