"""megart plan with --moe-grouped-gemm: the grouped experts cast their weights' stack for each
product and keep no 16-bit copy under autocast (models.moe_grouped), so with --bf16 (fp32
weights) a rank holds its routed experts' 2 bytes an element fewer autocast copies than without
the flag; every other part is the same. The experts' elements are counted on the real model's
parameters of the rank (ep2: half of each layer's experts)."""

from __future__ import annotations

import json

import pytest

from megart.cli.main import main as megart_main
from megart.models import GPT, GPTConfig

MODEL = dict(num_layers=4, hidden_size=256, num_attention_heads=8, seq_length=512,
             vocab_size=1000, num_experts=8, moe_ffn_hidden_size=512, moe_layer_freq=2)  # fmt: skip


def _flags(kw: dict) -> list[str]:
    out = []
    for k, v in kw.items():
        out += [f"--{k.replace('_', '-')}", str(v)]
    return out


def _memory(capsys, *more: str) -> dict:
    flags = [*_flags(MODEL), "--swiglu", "--disable-bias-linear", "--global-batch-size", "8",
             "--micro-batch-size", "1", "--tensor-model-parallel-size", "1",
             "--pipeline-model-parallel-size", "1", "--expert-model-parallel-size", "2",
             "--bf16", "--json", *more]  # fmt: skip
    assert megart_main(["plan", "--gpu", "h100-80gb", "--num-gpus", "2", *flags]) == 0
    return json.loads(capsys.readouterr().out)["memory_gib"]


def test_grouped_experts_hold_no_autocast_copies(capsys):
    loop, grouped = _memory(capsys), _memory(capsys, "--moe-grouped-gemm")
    cfg = GPTConfig(**MODEL, activation="swiglu", bias=False)
    experts = sum(p.numel() for n, p in GPT(cfg).named_parameters() if ".mlp.experts." in n)
    held = experts // 2  # ep2: each rank holds half of every MoE layer's experts
    assert held > 0
    gib = 2**30
    assert (loop["autocast_copies"] - grouped["autocast_copies"]) * gib == pytest.approx(2 * held)
    for part in ("parameters", "gradients", "optimizer", "activations"):
        assert grouped[part] == loop[part], part
