"""megart export-hf reads a checkpoint in every --ckpt-format megart train writes: a
torch_dist store (whole tensors, read as convert-checkpoint reads Megatron-LM's) and the
legacy torch files export exactly what megart's own format of the same run exports, at the
iteration asked for."""

import json

import pytest
import torch

import train_workers as tw
from megart.launcher import launch
from megart.training.export_hf import export_checkpoint

pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors.torch")

LLAMA = dict(normalization="RMSNorm", position_embedding_type="rope", swiglu=True,
             disable_bias_linear=True, group_query_attention=True, num_query_groups=2,
             untie_embeddings_and_output_weights=True)  # fmt: skip
PP2 = dict(pipeline_model_parallel_size=2, train_iters=2, save_interval=1)


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    """The same pp2 run saved at iterations 1 and 2 in each format: {format: directory}."""
    root = tmp_path_factory.mktemp("formats")
    out = {}
    for fmt in ("megart", "torch", "torch_dist"):
        out[fmt] = root / fmt
        kw = dict(LLAMA, **PP2, save=str(out[fmt]), ckpt_format=fmt)
        launch(tw.train_kw, 2, kw, timeout=300)
    return out


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
@pytest.mark.parametrize("iteration", [1, None])
def test_every_format_exports_what_megarts_own_does(stores, tmp_path, fmt, iteration):
    want = export_checkpoint(stores["megart"], tmp_path / "want", iteration)
    got = export_checkpoint(stores[fmt], tmp_path / "got", iteration)
    expected = safetensors.load_file(str(want / "model.safetensors"))
    tensors = safetensors.load_file(str(got / "model.safetensors"))
    assert tensors.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(tensors[name], value), name
    assert json.loads((got / "config.json").read_text()) == json.loads(
        (want / "config.json").read_text()
    )
    # Nothing of the release checkpoint a torch_dist export goes through is left behind.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["got", "want"]


def test_the_iterations_differ(stores, tmp_path):
    """So that an export ignoring --iteration would fail the test above."""
    one = export_checkpoint(stores["torch_dist"], tmp_path / "one", 1)
    two = export_checkpoint(stores["torch_dist"], tmp_path / "two", 2)
    a = safetensors.load_file(str(one / "model.safetensors"))
    b = safetensors.load_file(str(two / "model.safetensors"))
    assert not torch.equal(a["model.norm.weight"], b["model.norm.weight"])
