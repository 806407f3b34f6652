"""Uneven pipeline stages in Megatron-LM's checkpoint formats. Legacy (--ckpt-format torch):
each rank's file numbers its layers from 0, and layer i of pipeline rank r's file is layer
offset + i of the model, the offset Megatron-Core's get_transformer_layer_offset gives for the
uneven split its args record; such files, as Megatron-LM writes them (without megart's own
record), resume under an even layout on the uninterrupted curve, and convert-checkpoint reads
them. torch_dist (global layer numbers) resumes under another layout too."""

import re
import shutil

import pytest
import torch

import train_workers as tw
from megart.launcher import launch
from megart.training.checkpoint import FILE, iteration_dir

pytest.importorskip("megatron.core")

BASE = dict(num_layers=6, vocab_size=300, lr_decay_iters=5)
REL = 5e-6  # as test_checkpoint_reshard
UNEVEN4 = dict(
    pipeline_model_parallel_size=4,
    decoder_first_pipeline_num_layers=1,
    decoder_last_pipeline_num_layers=1,
)


def _run(nproc, kw):
    return launch(tw.train_holding, nproc, {**BASE, **kw}, timeout=300)


def _losses(rank):
    return [h["loss"] for h in rank["history"]]


def _megatron_offsets(args, pp):
    """Megatron-Core's first layer of each pipeline rank for the split ``args`` record."""
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    cfg = TransformerConfig(
        num_layers=args.num_layers,
        hidden_size=8,
        num_attention_heads=1,
        pipeline_model_parallel_size=pp,
        pipeline_dtype=torch.float32,
        num_layers_in_first_pipeline_stage=args.decoder_first_pipeline_num_layers,
        num_layers_in_last_pipeline_stage=args.decoder_last_pipeline_num_layers,
    )
    return [get_transformer_layer_offset(cfg, None, r) for r in range(pp)]


@pytest.fixture(scope="module")
def straight():
    return _losses(_run(1, dict(train_iters=5))[0])


def test_legacy_files_number_layers_from_megatron_cores_offsets(straight, tmp_path):
    ckpt = tmp_path / "ckpt"
    # Stopped at 2 of 4 iterations: Megatron's scheduler state records the run's length.
    kw = dict(train_iters=4, exit_interval=2, save=str(ckpt), ckpt_format="torch", **UNEVEN4)
    per_rank = _run(4, kw)
    assert _losses(per_rank[0]) == pytest.approx(straight[:2], rel=REL, abs=0)
    held = tw.merged_by_place([r["trained"] for r in per_rank], "weights")
    root = iteration_dir(ckpt, 2)
    raw = [torch.load(root / f"mp_rank_00_{r:03d}" / FILE, weights_only=False) for r in range(4)]
    args = raw[0]["args"]
    assert (args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers) == (1, 1)
    offsets = _megatron_offsets(args, 4)
    seen, counts = [], []
    for r, state in enumerate(raw):
        local = sorted(
            {int(m[1]) for k in state["model"] if (m := re.match(r"decoder\.layers\.(\d+)\.", k))}
        )
        assert local == list(range(len(local)))
        counts.append(len(local))
        for i in local:  # the MLP's output projection: the same matrix in both namings
            theirs = state["model"][f"decoder.layers.{i}.mlp.linear_fc2.weight"]
            assert torch.equal(theirs, held[f"chunk.blocks.{offsets[r] + i}.mlp.proj.weight"])
            seen.append(offsets[r] + i)
    assert counts == [1, 2, 2, 1] and sorted(seen) == list(range(6))

    # As Megatron-LM writes them: no megart record, no checksums; resumed under even pp2.
    theirs = tmp_path / "as-megatron-writes-it"
    shutil.copytree(ckpt, theirs)
    for r, state in enumerate(raw):
        del state["megart"]
        rank = iteration_dir(theirs, 2) / f"mp_rank_00_{r:03d}"
        torch.save(state, rank / FILE)
        for sums in rank.glob("*.sha256"):
            sums.unlink()
    ranks = _run(2, dict(train_iters=4, load=str(theirs), pipeline_model_parallel_size=2))
    loaded = tw.merged_by_place([r["loaded"] for r in ranks], "weights")
    assert loaded.keys() == held.keys()
    assert all(loaded[k].equal(v) for k, v in held.items())
    assert _losses(ranks[0]) == pytest.approx(straight[2:4], rel=REL, abs=0)

    from megart.training.megatron_checkpoint import megart_to_megatron, read_megatron

    # convert-checkpoint --from megart --to megatron keeps the source's uneven split.
    converted = tmp_path / "converted"
    paths = megart_to_megatron(ckpt, converted)
    args = torch.load(paths[0], weights_only=False)["args"]
    assert (args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers) == (1, 1)
    for d in (theirs, converted):
        cfg, model, _ = read_megatron(d)
        for g in range(6):
            assert torch.equal(model[f"decoder.layers.{g}.mlp.linear_fc2.weight"],
                               held[f"chunk.blocks.{g}.mlp.proj.weight"])  # fmt: skip


def test_torch_dist_uneven_checkpoint_resumes_under_another_layout(straight, tmp_path):
    pytest.importorskip("psutil")  # Megatron-Core's torch_dist strategy needs it
    ckpt = tmp_path / "ckpt"
    kw = dict(train_iters=4, exit_interval=2, save=str(ckpt), ckpt_format="torch_dist")
    _run(4, {**kw, **UNEVEN4})
    back = dict(pipeline_model_parallel_size=2, decoder_last_pipeline_num_layers=1)
    ranks = _run(2, dict(train_iters=4, load=str(ckpt), ckpt_format="torch_dist", **back))
    assert _losses(ranks[0]) == pytest.approx(straight[2:4], rel=REL, abs=0)
