"""megart import-hf: a Hugging Face GPT-2 becomes a release checkpoint that megart train loads
under any layout (resharded) as --finetune does, and whose first training loss is the loss
transformers' GPT-2 computes on the same batch."""

import pytest
import torch

import train_workers as tw
from megart import ConfigError
from megart.cli.main import main as megart_main
from megart.launcher import launch
from megart.models import GPT
from megart.training.import_hf import import_checkpoint

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors.torch")

# tiny()'s model (train_workers), with GPT-2's 32 positions of which the checkpoint keeps 16.
HF = dict(vocab_size=256, n_positions=32, n_embd=32, n_layer=4, n_head=4)
NO_DROPOUT = dict(hidden_dropout=0.0, attention_dropout=0.0)


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpt2")
    torch.manual_seed(0)
    config = transformers.GPT2Config(**HF, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    transformers.GPT2LMHeadModel(config).save_pretrained(root)
    return root


@pytest.fixture(scope="module")
def imported(gpt2, tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("ckpt")
    import_checkpoint(gpt2, ckpt, seq_length=16)
    return ckpt


@pytest.fixture(scope="module")
def imported_tp2_pp2(gpt2, tmp_path_factory):
    """The import written as a tp2 x pp2 layout's four files."""
    ckpt = tmp_path_factory.mktemp("ckpt_tp2_pp2")
    assert len(import_checkpoint(gpt2, ckpt, seq_length=16, tp=2, pp=2)) == 4
    return ckpt


def hf_loss(gpt2, inputs, targets):
    """The mean next-token cross-entropy of transformers' own model on one global batch."""
    model = transformers.GPT2LMHeadModel.from_pretrained(gpt2).eval()
    with torch.no_grad():
        logits = model(inputs).logits
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten()).item()


TP2_PP2 = dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)


@pytest.mark.parametrize(
    "nproc, layout, saved_for",
    [
        (1, {}, "one file"),
        (4, TP2_PP2, "one file"),
        (
            2,
            dict(pipeline_model_parallel_size=2, num_layers_per_virtual_pipeline_stage=1),
            "one file",
        ),
        (4, TP2_PP2, "tp2-pp2"),  # each rank reads its own file
        (1, {}, "tp2-pp2"),  # merged back
    ],
    ids=["one-process", "tp2-pp2", "pp2-interleaved", "tp2-pp2-files", "tp2-pp2-files-merged"],
)
def test_a_release_checkpoint_trains_from_gpt2_under_any_layout(
    gpt2, request, nproc, layout, saved_for
):
    imported = request.getfixturevalue(
        "imported" if saved_for == "one file" else "imported_tp2_pp2"
    )
    # No warm-up: Megatron's starts at rate 0, and the first step is the one tested.
    kw = dict(load=str(imported), train_iters=2, lr_warmup_iters=0, **NO_DROPOUT, **layout)
    runs = launch(tw.loaded_and_first_step, nproc, kw, timeout=300)
    reference = dict(GPT.from_hf_gpt2(str(gpt2)).named_parameters())
    merged = {}
    for loaded, _, _ in runs:
        merged.update(loaded)
    assert merged.keys() == reference.keys()
    for name, value in merged.items():
        want = reference[name].detach()[: value.shape[0]]  # 16 of GPT-2's 32 positions
        assert torch.equal(value, want), name
    loaded, history, (inputs, targets) = runs[0]
    assert [h["iteration"] for h in history] == [1, 2]  # weights only: iteration 0 on
    # fp32 on both sides, different arithmetic (attention, GeLU): agree to ~1e-6.
    assert history[0]["loss"] == pytest.approx(hf_loss(gpt2, inputs, targets), rel=1e-5)
    assert history[1]["loss"] < history[0]["loss"]


def test_import_hf_cli_and_its_errors(gpt2, tmp_path, capsys):
    assert megart_main(["import-hf", "--input", str(gpt2), "--save", str(tmp_path / "a")]) == 0
    assert "release checkpoint" in capsys.readouterr().out
    args = ["import-hf", "--input", str(gpt2), "--save", str(tmp_path / "b"), "--seq-length"]
    assert megart_main([*args, "64"]) == 2
    assert "has 32 learned positions; give 1 to 32" in capsys.readouterr().err
    assert megart_main(["import-hf", "--input", str(tmp_path), "--save", str(tmp_path)]) == 2
    assert "no config.json" in capsys.readouterr().err


def test_a_release_checkpoint_of_another_model_is_refused(imported):
    kw = dict(load=str(imported), seq_length=32)  # the checkpoint kept 16 positions
    with pytest.raises(Exception, match=r"--seq-length 16 \(now 32\)"):
        launch(tw.loaded_and_first_step, 1, kw, timeout=120)


def test_import_checkpoint_refuses_more_positions_than_gpt2_has(gpt2, tmp_path):
    with pytest.raises(ConfigError, match="give 1 to 32"):
        import_checkpoint(gpt2, tmp_path, seq_length=33)
