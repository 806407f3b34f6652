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
from megart.training.checkpoint import FILE, iteration_dir

pytest.importorskip("megatron.core")

from test_uneven_stages import megatron_ranges  # noqa: E402  (needs megatron.core)
from test_uneven_train import REL, UNEVEN4, _losses, _run  # noqa: E402


def _megatron_offsets(args, pp):
    """Megatron-Core's first layer of each pipeline rank for the split ``args`` record."""
    ends = args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers
    return _megatron_places(args.num_layers, pp, *ends)[0]


def _megatron_places(num_layers, pp, first, last):
    """Megatron-Core 0.16.1's first layer and number of layers of each pipeline rank."""
    ranges = [megatron_ranges(num_layers, pp, 1, first, last)[r, 0] for r in range(pp)]
    return [r.start for r in ranges], [len(r) for r in ranges]


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
        local = _local_layers(state)
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


def _local_layers(state):
    return sorted(
        {int(m[1]) for k in state["model"] if (m := re.match(r"decoder\.layers\.(\d+)\.", k))}
    )


def test_convert_checkpoint_writes_target_uneven_stages(tmp_path, capsys):
    """--target-decoder-first/last-pipeline-num-layers: a one-process checkpoint written as
    pp3 with 1|2|3 layers (and pp2 with 4|2 and the first alone, as Megatron's args take it),
    each rank file's layers where Megatron-Core places them; merged, the source's weights;
    megart train --load of them under even pp2 holds exactly those weights and gives the loss
    of --finetune from the source. torch_dist records the split in args. Refused by name
    where they mean nothing, and splits that do not fit with megart train's text, before
    anything is written."""
    from megart.cli.main import main
    from megart.training import megatron_dist
    from megart.training.megatron_checkpoint import read_megatron

    ckpt = tmp_path / "ckpt"
    source = _run(1, dict(train_iters=2, save=str(ckpt)))[0]
    held = source["trained"]["weights"]
    write = ["convert-checkpoint", "--from", "megart", "--to", "megatron", "--load", str(ckpt)]
    first, last = (f"--target-decoder-{end}-pipeline-num-layers" for end in ("first", "last"))
    for pp, ends in ((3, (1, 3)), (2, (4, None))):
        out = tmp_path / f"pp{pp}"
        flags = [first, str(ends[0])] + ([last, str(ends[1])] if ends[1] else [])
        assert main([*write, "--save", str(out), "--target-pipeline-parallel-size", str(pp),
                     *flags]) == 0  # fmt: skip
        root = iteration_dir(out, 2)
        raw = [torch.load(root / f"mp_rank_00_{r:03d}" / FILE, weights_only=False)
               for r in range(pp)]  # fmt: skip
        args = raw[0]["args"]
        ends_written = args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers
        assert ends_written == ends
        offsets, counts = _megatron_places(6, pp, *ends)
        seen = []
        for r, state in enumerate(raw):
            assert _local_layers(state) == list(range(counts[r]))
            for i in range(counts[r]):
                theirs = state["model"][f"decoder.layers.{i}.mlp.linear_fc2.weight"]
                assert torch.equal(theirs, held[f"chunk.blocks.{offsets[r] + i}.mlp.proj.weight"])
                seen.append(offsets[r] + i)
        assert sorted(seen) == list(range(6))
        _, model, _ = read_megatron(out)
        for g in range(6):
            assert torch.equal(model[f"decoder.layers.{g}.self_attention.linear_qkv.weight"],
                               held[f"chunk.blocks.{g}.attn.qkv.weight"])  # fmt: skip

    run = dict(train_iters=2, pipeline_model_parallel_size=2)
    ranks = _run(2, dict(run, load=str(tmp_path / "pp3")))
    loaded = tw.merged_by_place([r["loaded"] for r in ranks], "weights")
    assert loaded.keys() == held.keys()
    assert all(loaded[k].equal(v) for k, v in held.items())
    tuned = _run(1, dict(train_iters=2, load=str(ckpt), finetune=True))[0]
    assert _losses(ranks[0]) == pytest.approx(_losses(tuned), rel=REL, abs=0)

    pytest.importorskip("psutil")  # Megatron-Core's torch_dist strategy needs it
    dist = tmp_path / "dist"
    assert main([*write, "--save", str(dist), "--ckpt-format", "torch_dist",
                 "--target-pipeline-parallel-size", "3", first, "1", last, "3"]) == 0  # fmt: skip
    args = megatron_dist.read_common(iteration_dir(dist, 2))["args"]
    assert (args.pipeline_model_parallel_size, args.decoder_first_pipeline_num_layers,
            args.decoder_last_pipeline_num_layers) == (3, 1, 3)  # fmt: skip

    capsys.readouterr()
    bad = tmp_path / "bad"
    train_text = (
        "leave 3 of --num-layers 6 layers for the other 2 pipeline stage(s), which hold them "
        "evenly: 3 is not a positive multiple of 2 stage(s) = 2; use "
        "--decoder-first-pipeline-num-layers 2, or --decoder-last-pipeline-num-layers 1 or 3"
    )
    zero = "--decoder-first-pipeline-num-layers 0 must be at least 1"
    for flags, text in (
        (["--target-pipeline-parallel-size", "4", first, "1", last, "2"], train_text),
        (["--target-pipeline-parallel-size", "2", first, "2", last, "2"], "must add up to"),
        (["--target-pipeline-parallel-size", "1", first, "2"], "at least 2"),
        ([first, "0", "--target-pipeline-parallel-size", "2"], zero),
    ):
        assert main([*write, "--save", str(bad), *flags]) == 2
        err = capsys.readouterr().err
        assert text in err and "--target-decoder-first/last-pipeline-num-layers" in err, err
        assert not bad.exists()
    assert main([*write[:4], "hf", *write[5:], "--save", str(bad), last, "2"]) == 2
    err = capsys.readouterr().err
    assert f"{last} set the pipeline stages" in err and "--to megatron only" in err
    assert not bad.exists()
