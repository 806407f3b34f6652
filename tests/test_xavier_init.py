"""--init-method-xavier-uniform: every weight that --init-method-std would draw (embeddings,
projections, output layer) is U(-a, a) with a = sqrt(6 / (fan_in + fan_out)) of the whole tensor
as Megatron-Core holds it (fused qkv; SwiGLU's fused fc1, 2 ffn rows; the vocabulary padded as
at tensor-parallel size 1); a weight with its own shape is torch's xavier_uniform_ from the same
generator, bit for bit; tp2 shards and pp2 stages hold the one-process weights, bit for bit."""

import argparse
import math

import pytest
import torch

import train_workers as tw
from megart.cli.train import add_arguments, config_from_args
from megart.launcher import launch
from megart.models import GPT, GPTConfig
from megart.models.init import generator

BASE = dict(vocab_size=1000, seq_length=64, hidden_size=64, num_layers=2, num_attention_heads=4,
            init_method_xavier_uniform=True)  # fmt: skip
LLAMA = dict(normalization="rmsnorm", position_embedding="rotary", activation="swiglu",
             ffn_hidden_size=96, bias=False, untie_embeddings_and_output_weights=True,
             num_query_groups=2)  # fmt: skip


def megatron_shapes(cfg: GPTConfig) -> dict[str, tuple[int, int]]:
    """[out, in] of the tensor Megatron-Core holds for each of megart's weights."""
    h, f, d = cfg.hidden_size, cfg.ffn_size, cfg.head_dim
    vocab = (cfg.padded_vocab_size(1), h)
    fc1 = (2 * f if cfg.activation == "swiglu" else f, h)
    shapes = {"chunk.wte.weight": vocab, "chunk.wpe.weight": (cfg.seq_length, h),
              "chunk.output_layer.weight": vocab}  # fmt: skip
    for i in range(cfg.num_layers):
        block = f"chunk.blocks.{i}."
        shapes |= {
            block + "attn.qkv.weight": ((cfg.num_attention_heads + 2 * cfg.query_groups) * d, h),
            block + "attn.proj.weight": (h, h),
            block + "mlp.fc.weight": fc1,
            block + "mlp.gate.weight": fc1,
            block + "mlp.proj.weight": (h, f),
        }
    return shapes


@pytest.mark.parametrize("kw", [BASE, {**BASE, **LLAMA}], ids=["gpt2", "llama"])
def test_each_weight_is_uniform_within_glorots_bound_of_megatron_cores_shape(kw):
    cfg = GPTConfig(**kw)
    model = GPT(cfg)
    shapes = megatron_shapes(cfg)
    weights = {n: p.detach() for n, p in model.named_parameters() if n in shapes}
    # Every matrix of the model is one of them (norms and biases keep their 1s and 0s).
    assert weights.keys() == {n for n, p in model.named_parameters() if p.dim() == 2}
    for name, w in weights.items():
        out, in_ = shapes[name]
        bound = math.sqrt(6 / (in_ + out))
        if "wte" in name or "output_layer" in name:
            w = w[: cfg.vocab_size]  # the padded rows are zero
        assert w.abs().max() <= bound, name
        assert w.abs().max() > 0.98 * bound, name  # thousands of draws reach the edge
        # U(-a, a): mean 0, variance a^2 / 3 (standard errors of a few thousand draws).
        n = w.numel()
        assert abs(w.mean()) < 5 * bound / math.sqrt(3 * n), name
        assert w.var().item() == pytest.approx(bound**2 / 3, rel=10 / math.sqrt(n)), name
    # A weight Megatron-Core holds with megart's shape is torch's own xavier_uniform_.
    want = torch.nn.init.xavier_uniform_(torch.empty(cfg.hidden_size, cfg.hidden_size),
                                         generator=generator(cfg.seed, 0, "proj"))  # fmt: skip
    assert torch.equal(model.chunk.blocks[0].attn.proj.weight, want)


def test_without_the_flag_the_weights_are_normal_as_before():
    plain = GPT(GPTConfig(**{**BASE, "init_method_xavier_uniform": False}))
    w = plain.chunk.blocks[0].attn.qkv.weight.detach()
    want = torch.empty(w.shape).normal_(0, 0.02, generator=generator(1234, 0, "qkv"))
    assert torch.equal(w, want)


TRAIN = dict(
    init_method_xavier_uniform=True,
    swiglu=True,
    untie_embeddings_and_output_weights=True,
    group_query_attention=True,
    num_query_groups=2,
    make_vocab_size_divisible_by=100,
)  # fmt: skip  (256 pads to 300 at t1, 400 at t2)


def test_tp2_shards_and_pp2_stages_hold_the_one_process_weights():
    one = launch(tw.initial_weights, 1, TRAIN, timeout=300)[0]
    assert one["chunk.blocks.0.attn.qkv.weight"].abs().max() > 0.1  # Glorot's, not 0.02's
    for layout in (dict(tensor_model_parallel_size=2), dict(pipeline_model_parallel_size=2)):
        held = {}
        for per_rank in launch(tw.initial_weights, 2, {**TRAIN, **layout}, timeout=300):
            held |= per_rank
        assert held.keys() == one.keys()
        for name, w in one.items():
            rows = 256 if "output_layer" in name else None  # its padding depends on t
            assert torch.equal(held[name][:rows], w[:rows]), (layout, name)


def test_the_flag_reaches_gpt_config():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    parse = lambda *argv: config_from_args(parser.parse_args(argv)).gpt_config()  # noqa: E731
    assert parse("--init-method-xavier-uniform").init_method_xavier_uniform
    assert not parse().init_method_xavier_uniform
