"""--untie-embeddings-and-output-weights: the output layer has its own vocab-parallel weight.
It follows the single-process loss curve under every layout (no embedding gradient is shared
between stages then), resumes resharded from a tp2 x pp2 checkpoint, and a checkpoint of the
other kind is refused naming the flag."""

import pytest
import torch

import train_workers as tw
from megart.launcher import LaunchError, launch
from megart.models import GPT, GPTConfig

UNTIED = dict(untie_embeddings_and_output_weights=True)
# vocab 300 pads to 384 under tp1 and 512 under tp2: resharding refits the output layer's rows.
BASE = dict(vocab_size=300, lr_decay_iters=5, **UNTIED)


def test_the_output_layer_has_its_own_weight():
    cfg = GPTConfig(vocab_size=300, seq_length=16, hidden_size=32, num_layers=2,
                    num_attention_heads=4, **UNTIED)  # fmt: skip
    model = GPT(cfg)
    tokens = torch.randint(0, 300, (2, 16))
    model(tokens, tokens).backward()
    head, wte = model.chunk.output_layer.weight, model.chunk.wte.weight
    assert head.shape == wte.shape and not torch.equal(head, wte)
    assert head.grad is not None and wte.grad is not None
    # The logits are the final norm's output times the output layer's weight alone.
    with torch.no_grad():
        x = model.chunk.wte(tokens.t()) + model.chunk.wpe.weight[:16].unsqueeze(1)
        for block in model.chunk.blocks:
            x = block(x, None)
        logits = model.chunk.ln_f(x) @ head.t()
        torch.testing.assert_close(model(tokens), logits[..., :300].transpose(0, 1))
    assert float(head.detach()[300:].abs().max()) == 0.0  # padding rows stay zero


@pytest.fixture(scope="module")
def reference():
    return launch(tw.train_kw, 1, BASE, timeout=300)[0]


LAYOUTS = {
    "tp2-sequence-parallel": (2, dict(tensor_model_parallel_size=2, sequence_parallel=True)),
    "pp2-interleaved": (
        2,
        dict(pipeline_model_parallel_size=2, num_layers_per_virtual_pipeline_stage=1),
    ),
    "pp2-dp2-distributed-optimizer": (
        4,
        dict(pipeline_model_parallel_size=2, use_distributed_optimizer=True),
    ),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_every_layout_follows_the_single_process_loss_curve(name, reference):
    nproc, layout = LAYOUTS[name]
    for history in launch(tw.train_kw, nproc, {**BASE, **layout}, timeout=300):
        for h, r in zip(history, reference, strict=True):
            assert h["loss"] == pytest.approx(r["loss"], rel=1e-5)
            assert h["grad_norm"] == pytest.approx(r["grad_norm"], rel=1e-5)


def test_a_tp2_pp2_checkpoint_resumes_resharded_under_tp1(tmp_path):
    straight = launch(tw.train_kw, 1, dict(train_iters=4, **BASE), timeout=300)[0]
    layout = dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    launch(tw.train_kw, 4, dict(train_iters=2, save=str(tmp_path), **BASE, **layout), timeout=300)
    resumed = launch(tw.train_kw, 1, dict(train_iters=4, load=str(tmp_path), **BASE), timeout=300)[
        0
    ]
    assert [h["iteration"] for h in resumed] == [3, 4]
    assert [h["loss"] for h in resumed] == pytest.approx(
        [h["loss"] for h in straight[2:]], rel=5e-6, abs=0
    )


def test_a_tied_checkpoint_is_refused_naming_the_flag(tmp_path):
    launch(tw.train_kw, 1, dict(train_iters=1, save=str(tmp_path)), timeout=300)
    with pytest.raises(LaunchError, match="no --untie-embeddings-and-output-weights \\(now "):
        launch(tw.train_kw, 1, dict(train_iters=2, load=str(tmp_path), **UNTIED), timeout=300)
