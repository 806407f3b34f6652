"""Launched workers of test_megatron_mla_ckpt: what Megatron-Core 0.16.1's GPTModel with
multi-latent attention (local spec, megatron_core_workers) says about its own checkpoint
layout at the world's tensor-parallel size; and the runs test_megatron_mla_ckpt and
test_megatron_mla_yarn share (megart train's Megatron-format saves, Megatron-Core's logits on
them, convert-checkpoint both ways)."""

from __future__ import annotations

import os

import torch

import megatron_core_workers as mcw
from megart.models import GPTConfig


def megatron_layout(kw: dict) -> dict:
    """On each launched rank (tensor-parallel ranks): Megatron-Core's GPTModel of
    ``GPTConfig(**kw)``: its state dict's names in order (tensors' shapes; None for an
    ``_extra_state``) and its sharded state dict's tensors, each as (key, global shape, the
    pieces each of the tensor's own axes is cut in, whether it is SwiGLU's [gate; up] cut in
    halves too), ``_extra_state`` objects as their keys."""
    from megatron.core import parallel_state

    tp = int(os.environ["WORLD_SIZE"])
    torch.distributed.init_process_group("gloo")
    parallel_state.initialize_model_parallel(tp, 1)
    mcw.on_cpu_only()
    cfg = GPTConfig(**kw)
    model = mcw.megatron_model(cfg, tp)
    state = {k: None if v is None else tuple(v.shape) for k, v in model.state_dict().items()}
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensorFactory

    sharded, objects = {}, set()
    for name, v in model.sharded_state_dict().items():
        if isinstance(v, ShardedObject):  # an extra state
            objects.add(v.unique_key)
            continue
        halves = isinstance(v, ShardedTensorFactory)
        if halves:  # SwiGLU's fc1: its gate's piece (of 2 tp on its rows) tells
            v = next(iter(_tensors(v.build())))
        # How many pieces the tensor's own axes are cut in (after its layer's and expert's).
        own = tuple(v.axis_fragmentations[v.prepend_axis_num :])
        sharded[name] = (v.key, tuple(v.global_shape), own, halves)
    torch.distributed.destroy_process_group()
    return {"state": state, "sharded": sharded, "objects": objects}


def _tensors(built):
    """The sharded tensors a factory built (one, or a list or dict of them)."""
    if isinstance(built, dict):
        return built.values()
    return built if isinstance(built, (list, tuple)) else [built]


def tokens(cfg: GPTConfig) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, (2, cfg.seq_length),
                         generator=torch.Generator().manual_seed(5))  # fmt: skip


def saved_runs(factory, train: dict, saves: dict) -> dict:
    """Per case of ``saves`` (name: processes, flags, format): megart train's checkpoint of
    ``train`` with the case's flags, in its format, after 2 of 3 iterations (its folder)."""
    from megart.launcher import launch
    from train_workers import train_kw

    out = {}
    for name, (nproc, flags, fmt) in saves.items():
        ckpt = factory.mktemp(name) / "ckpt"
        kw = dict(train, **flags, save=str(ckpt), exit_interval=2, ckpt_format=fmt)
        launch(train_kw, nproc, kw, timeout=300)
        out[name] = ckpt
    return out


def megatron_core_logits(ckpt, fmt: str, tp: int, pp: int, toks: torch.Tensor) -> list:
    """The logits of ``toks`` that Megatron-Core's GPTModel of the args computes on each of its
    ``tp`` tensor-parallel ranks (of the last of ``pp`` stages) after loading Megatron-LM's
    checkpoint ``ckpt`` (``fmt`` torch: each rank its legacy file; torch_dist: its slices of
    the store), strictly."""
    import megatron_dist_workers as mdw
    from megart.launcher import launch

    if fmt == "torch":
        assert pp == 1
        return launch(mcw.tp_rank_logits, tp, str(ckpt), toks, timeout=300)
    got = launch(mdw.load_and_run, tp * pp, str(ckpt), toks, tp, pp, timeout=300)
    return [r for r in got if r is not None]


def converted_both_ways(tmp_path, train: dict, fmt: str) -> str:
    """megart train's 1-iteration checkpoint of ``train`` in megart's format, converted to
    Megatron-LM's ``fmt`` at tensor-parallel size 2 and back (that folder returned): checks
    that Megatron-Core's two ranks compute its float64 logits on the converted files and that
    the weights converted back are the checkpoint's."""
    import megatron_core_ckpt_workers as mckw
    from megart.cli.main import main
    from megart.launcher import launch
    from train_workers import tiny, train_kw

    ours, out, back = (str(tmp_path / n) for n in ("megart", "megatron", "back"))
    launch(train_kw, 1, dict(train, save=ours, train_iters=1), timeout=300)
    assert main(["convert-checkpoint", "--from", "megart", "--to", "megatron", "--ckpt-format",
                 fmt, "--target-tensor-parallel-size", "2", "--load", ours, "--save",
                 out]) == 0  # fmt: skip
    cfg = tiny(**train).gpt_config()
    want = launch(mckw.checkpoint_logits, 1, ours, tokens(cfg), timeout=300)[0]
    assert want.abs().max() > 0.1
    got = megatron_core_logits(out, fmt, 2, 1, tokens(cfg))
    assert len(got) == 2
    for logits in got:
        assert (logits[..., : cfg.vocab_size] - want).abs().max().item() < 1e-10
    assert main(["convert-checkpoint", "--from", "megatron", "--to", "megart", "--load", out,
                 "--save", back]) == 0  # fmt: skip
    theirs = launch(mckw.checkpoint_gpt, 1, back, timeout=300)[0][1]
    weights = launch(mckw.checkpoint_gpt, 1, ours, timeout=300)[0][1]
    assert set(theirs) == set(weights)
    assert all(torch.equal(theirs[k], v) for k, v in weights.items())
    return back
