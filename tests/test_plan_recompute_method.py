"""megart plan under --recompute-method/--recompute-num-layers, against how megart train runs a
chunk (models.recompute.recomputed_spans): block N replays the first N layers of each chunk and
runs the others as without recomputation; uniform N replays every layer, in groups of N. The
bytes a real rank saves are checked in tests/test_plan_memory.py ("uniform 2", "block" cases)."""

import pytest

from megart.plan.estimate import estimate
from megart.plan.hardware import load_profile
from megart.plan.layout import Layout
from megart.plan.timing import layer_work, logits_work
from megart.training.config import TrainConfig
from megart.training.flops import model_flops

GPU = load_profile("h100-80gb")
MODEL = dict(num_layers=8, hidden_size=2048, num_attention_heads=16, seq_length=4096,
             vocab_size=32000, global_batch_size=8, bf16=True)  # fmt: skip


def _estimate(recompute, pp=1, **kw):
    layout = Layout(1, pp, 1, 1, 1, False, recompute, False)
    return estimate(TrainConfig(**MODEL, **kw), layout, GPU, simulate=False)


@pytest.mark.parametrize("n", [1, 3, 7])
def test_block_replays_the_first_n_layers_of_a_chunk_only(n):
    config = TrainConfig(**MODEL, recompute_granularity="full")
    cfg = config.gpt_config()
    again = layer_work(cfg, 1, 1, False, "full", GPU)
    once = layer_work(cfg, 1, 1, False, None, GPU)
    e = _estimate("full", recompute_method="block", recompute_num_layers=n)
    want = again * n + once * (8 - n) + logits_work(cfg, 1, 1, GPU)
    assert e.stage.backward == pytest.approx(want.backward)
    assert e.stage.forward == pytest.approx(want.forward)
    assert _estimate(None).iteration_time < e.iteration_time < _estimate("full").iteration_time
    # The paper's convention counts the replayed forward: of n layers in 8.
    plain = model_flops(cfg, 8, causal=False)
    replayed = model_flops(cfg, 8, recompute=True, causal=False) - plain
    run = e.tflops_per_gpu * e.iteration_time * 1e12
    assert run == pytest.approx(plain + replayed * n / 8)


def test_every_layer_replayed_is_the_default_whatever_the_grouping():
    """Block over all of a chunk's layers and uniform groups of any size replay each layer
    once: the time of uniform 1; only the memory of the groups differs."""
    default = _estimate("full", pp=2)
    for kw in (dict(recompute_method="block", recompute_num_layers=4),
               dict(recompute_method="uniform", recompute_num_layers=2)):  # fmt: skip
        e = _estimate("full", pp=2, **kw)
        assert e.iteration_time == pytest.approx(default.iteration_time)
        assert e.tflops_per_gpu == pytest.approx(default.tflops_per_gpu)
    grouped = _estimate("full", pp=2, recompute_num_layers=2)
    assert grouped.memory["activations"] > default.memory["activations"]  # two layers replayed


def test_block_keeps_more_activations_the_fewer_layers_it_replays():
    held = [
        _estimate("full", pp=2, recompute_method="block", recompute_num_layers=n).memory
        for n in (1, 2, 3, 4)
    ]
    acts = [m["activations"] for m in held]
    assert acts == sorted(acts, reverse=True) and len(set(acts)) == 4
    assert acts[0] < _estimate(None, pp=2).memory["activations"]
