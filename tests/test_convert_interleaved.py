"""convert-checkpoint --target-num-virtual-stages-per-pipeline-rank V: Megatron-LM's legacy files
of its interleaved schedule written from a one-process checkpoint, each rank file's model chunks
(model0, model1, ...) holding the layers Megatron-Core 0.16.1 builds there, numbered from 0 in
each chunk; megart train resumes them interleaved holding exactly the source's weights. The
flag is refused by name where it means nothing, and a V that does not fit before anything is
written."""

import re

import pytest
import torch

import train_workers as tw
from megart.training.checkpoint import FILE, iteration_dir

pytest.importorskip("megatron.core")

from test_uneven_stages import megatron_ranges  # noqa: E402  (needs megatron.core)
from test_uneven_train import _run  # noqa: E402

VPP = "--target-num-virtual-stages-per-pipeline-rank"


def _chunk_layers(chunk: dict) -> list[int]:
    return sorted({int(m[1]) for k in chunk if (m := re.match(r"decoder\.layers\.(\d+)\.", k))})


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("interleave") / "ckpt"
    return ckpt, _run(1, dict(train_iters=2, save=str(ckpt)))[0]["trained"]["weights"]


def test_interleaved_files_hold_megatron_cores_chunks(source, tmp_path):
    from megart.cli.main import main

    ckpt, held = source
    out = tmp_path / "pp3v2"
    assert main(["convert-checkpoint", "--from", "megart", "--to", "megatron", "--load",
                 str(ckpt), "--save", str(out), "--target-pipeline-parallel-size", "3",
                 VPP, "2"]) == 0  # fmt: skip
    root = iteration_dir(out, 2)
    places = megatron_ranges(6, 3, 2, None, None)
    seen = []
    for r in range(3):
        state = torch.load(root / f"mp_rank_00_{r:03d}" / FILE, weights_only=False)
        assert state["args"].virtual_pipeline_model_parallel_size == 2
        assert "model" not in state and {"model0", "model1"} <= state.keys()
        for c in range(2):
            layers = places[r, c]
            assert _chunk_layers(state[f"model{c}"]) == list(range(len(layers)))
            for i, g in enumerate(layers):
                theirs = state[f"model{c}"][f"decoder.layers.{i}.mlp.linear_fc2.weight"]
                assert torch.equal(theirs, held[f"chunk.blocks.{g}.mlp.proj.weight"])
                seen.append(g)
    assert sorted(seen) == list(range(6))

    run = dict(train_iters=2, pipeline_model_parallel_size=3, global_batch_size=12,
               num_layers_per_virtual_pipeline_stage=1)  # fmt: skip
    ranks = _run(3, dict(run, load=str(out)))
    loaded = tw.merged_by_place([r["loaded"] for r in ranks], "weights")
    assert loaded.keys() == held.keys()
    assert all(loaded[k].equal(v) for k, v in held.items())


def test_the_flag_is_refused_where_it_cannot_apply(source, tmp_path, capsys):
    from megart.cli.main import main

    ckpt, _ = source
    bad = tmp_path / "bad"
    write = ["convert-checkpoint", "--from", "megart", "--load", str(ckpt), "--save", str(bad)]
    assert main([*write, "--to", "hf", VPP, "2"]) == 2
    err = capsys.readouterr().err
    assert f"{VPP} set the pipeline stages" in err and "--to megatron only" in err
    # 6 layers do not split into 3 ranks x 4 chunks.
    assert main([*write, "--to", "megatron", "--target-pipeline-parallel-size", "3", VPP, "4"]) == 2
    err = capsys.readouterr().err
    assert "6 layers do not split into 3 pipeline stages x 4 chunks" in err
    assert f"{VPP} 4" in err
    assert not bad.exists()
