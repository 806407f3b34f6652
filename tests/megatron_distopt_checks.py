"""The two checks of a model's optimizer state in Megatron-LM's formats against Megatron-Core
0.16.1's own DistributedOptimizer at tp2 x dp2, shared by the models that need them
(test_megatron_mla_distopt, test_megatron_mtp_distopt): ``train`` is the model's
megart-train flags, ``marker`` a part of a Megatron parameter name that must be among the pieces
held (the model's own parameters reached Megatron-Core's buffers), ``losses`` the curve a
resume is compared on."""

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import megatron_core_workers as mcw
import train_workers as tw
from megart.launcher import launch
from megart.training.megatron_layout import shard


def check_distrib_optim(
    tmp_path: Path, train: dict, marker: str, losses: Callable[[list[dict]], list[float]]
) -> None:
    """--ckpt-format torch: Megatron-Core's DistributedDataParallel and DistributedOptimizer
    load megart's rank files and distrib_optim.pt and hold, piece by piece, the fp32 main
    weights and Adam moments of megart's own checkpoint of the same run; megart resumes what
    Megatron-Core then writes on the uninterrupted curve."""
    import megatron_distopt_workers as mdow

    kw = dict(train, train_iters=4, use_distributed_optimizer=True, tensor_model_parallel_size=2)
    ref, ours, theirs = (str(tmp_path / d) for d in ("ref", "megart", "megatron"))
    straight = launch(tw.train_kw, 4, dict(kw, save=ref, save_interval=2), timeout=300)[0]
    launch(tw.train_kw, 4, dict(kw, save=ours, save_interval=2, exit_interval=2,
                                ckpt_format="torch"), timeout=300)  # fmt: skip
    held = {}
    for rank in launch(mdow.load_and_write, 4, kw, ours, ref, theirs, timeout=300):
        assert rank["pieces"], rank["place"]
        for param, piece in rank["pieces"].items():
            assert max(piece["diffs"].values()) < 1e-5, (rank["place"], param, piece["diffs"])
            held.setdefault((*rank["place"][:2], param), []).append(
                (*piece["range"], piece["numel"])
            )
    assert any(marker in param for _, _, (_, param) in held)
    for ranges in held.values():  # the data-parallel pieces tile each parameter
        ranges.sort()
        assert ranges[0][0] == 0 and ranges[-1][1] == ranges[-1][2], ranges
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False)), ranges
    resumed = launch(tw.train_kw, 4, dict(kw, load=theirs), timeout=300)[0]
    assert losses(resumed) == pytest.approx(losses(straight[2:]), **tw.SAME_RUN)


def check_torch_dist_store(tmp_path: Path, train: dict, marker: str) -> None:
    """--ckpt-format torch_dist: Megatron-Core's DistributedOptimizer loads megart's store
    (Megatron-LM's default strictness) and holds, bitwise, megart's fp32 weights and moments at
    the save, its pieces tiling every parameter; megart resumes the store Megatron-Core then
    saves on the curve."""
    import megatron_dist_distopt_workers as w
    from megart.models.megatron_names import to_megatron
    from megart.training.checkpoint import iteration_dir
    from megart.training.megatron_dist import read_common
    from test_megatron_dist_distopt import MOMENTS, REL, _global_name, model_config_of

    flags = dict(train, tensor_model_parallel_size=2, use_distributed_optimizer=True)
    store, theirs = tmp_path / "ckpt", tmp_path / "theirs"
    straight = tw.holding(4, dict(flags, train_iters=4))[0]["history"]
    saving = tw.holding(4, dict(flags, train_iters=4, exit_interval=2, save=str(store),
                                ckpt_format="torch_dist"))  # fmt: skip
    held = launch(w.load_and_save, 4, flags, str(store), str(theirs), timeout=300)
    common = read_common(iteration_dir(store, 2))
    cfg = model_config_of(common)
    whole = {}
    for key in ("weights", *MOMENTS):
        merged = tw.merged_by_place([r["trained"] for r in saving], key)
        merged = {k.removeprefix("chunk."): v for k, v in merged.items()}
        whole[key] = to_megatron(merged, cfg)
        mcw.pad_vocab(whole[key], cfg, 2)  # the vocabulary padded for tp2 (zero rows)
    covered: dict[tuple, list] = {}
    for rank in held:
        t, p, _ = rank["place"]
        for (chunk, local), piece in rank["pieces"].items():
            start, end = piece["range"]
            full = _global_name(local, chunk, p, common["args"])
            for ours, key in (("weights", "param"), *((m, m) for m in MOMENTS)):
                # This tensor-parallel rank's slice, as the legacy layout cuts it.
                want = shard(full, whole[ours][full], cfg, 2, t).reshape(-1)[start:end]
                assert torch.equal(piece[key], want), (local, key, start)
            covered.setdefault((t, p, chunk, local), []).append((start, end))
    assert any(marker in k[3] for k in covered)
    for key, ranges in covered.items():
        ranges.sort()
        assert ranges[0][0] == 0, key
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False)), key
    resumed = tw.holding(4, dict(flags, train_iters=4, load=str(theirs)))
    tw.assert_resumed_on_curve(straight, resumed, rel=REL, abs=0)
