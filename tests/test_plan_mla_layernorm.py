"""megart plan with --recompute-modules layernorm beside multi-latent attention and multi-token
prediction's depths (their norms' outputs dropped and made again as the decoder's,
models.dropped_output; plan.recompute_memory.dropped_norms_rise, activations.layer_bytes):
the activations autograd saves at the peak on real megart train ranks are off by exactly what
the same run without layernorm is off by (MLA: nothing in fp32; the depths: their losses'
few bytes a token; bf16 within 1%: the dense layers' known CPU differences, less the norms'
weights' 16-bit casts, 1,024 B here, which the dropped norms do not save), parameters and state
exactly: tp1, tp2 with sequence parallelism, pp2, --q-lora-rank, --qk-layernorm, bf16 RMSNorm,
with core_attn and mlp. The norms' rise left out, or the depths' norms counted as kept, is
caught."""

from __future__ import annotations

import json
from unittest import mock

import pytest

from megart.cli.main import main as megart_main
from megart.launcher import launch
from megart.plan import memory
from megart.plan import mtp_memory as mm
from plan_memory_check import predicted_and_held
from plan_workers import held_bytes
from test_plan_memory_mla import ARGV, MLA, MLA_ARGV, MTP, PP2, Q_LORA, TP2

# (name, processes, flags without layernorm)
CASES = [
    ("mla", 1, MLA),
    ("mla q-lora qk-layernorm core_attn mlp", 1, dict(Q_LORA, qk_layernorm=True)),
    ("mla tp2 sp q-lora qk-layernorm", 2,
     dict(Q_LORA, **TP2, sequence_parallel=True, qk_layernorm=True)),
    ("mla pp2", 2, dict(MLA, **PP2)),
    ("mla bf16 rmsnorm q-lora", 1, dict(Q_LORA, bf16=True, normalization="RMSNorm")),
    ("mtp", 1, MTP),
    ("mtp pp2", 2, dict(MTP, **PP2)),
    ("mtp tp2 sp", 2, dict(MTP, **TP2, sequence_parallel=True)),
    ("mtp mla", 1, dict(MLA, mtp_num_layers=1)),
]  # fmt: skip
_HELD: dict[tuple[str, bool], list[dict]] = {}


def _flags(name: str, layernorm: bool) -> tuple[int, dict]:
    """A case's processes and flags, with or without layernorm among the modules."""
    _, nproc, kw = next(c for c in CASES if c[0] == name)
    modules = (["layernorm"] if layernorm else []) + (
        ["core_attn", "mlp"] if "core_attn" in name else []
    )
    if modules:
        kw = {**kw, "recompute_granularity": "selective", "recompute_modules": modules}
    return nproc, kw


def _gaps(name: str, layernorm: bool) -> list[float]:
    """Per rank: the saved peak less the plan's saves and a CPU's extra (the state's bytes
    checked exactly on the way)."""
    nproc, kw = _flags(name, layernorm)
    if (name, layernorm) not in _HELD:
        _HELD[name, layernorm] = launch(held_bytes, nproc, kw, timeout=300)
    out = []
    for held, want, cpu in predicted_and_held(nproc, kw, ranks=_HELD[name, layernorm]):
        for part in ("parameters", "gradients", "optimizer"):
            assert want[part] == held[part], (name, held, part, want[part])
        assert held["saved_after"] == 0
        out.append(held["saved_peak"] - want["saved"] - cpu)
    return out


@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_layernorm_recomputation_is_counted_as_a_rank_holds_it(name):
    gaps, without = _gaps(name, True), _gaps(name, False)
    if "bf16" not in name:
        assert gaps == without, (name, gaps, without)
    else:  # the norms' weights' 16-bit casts (a CPU's, uncounted) are not saved by them
        assert 0 < gaps[0] < without[0], (name, gaps, without)
    nproc, kw = _flags(name, True)
    for held, want, cpu in predicted_and_held(nproc, kw, ranks=_HELD[name, True]):
        assert held["saved_peak"] == pytest.approx(want["saved"] + cpu, rel=0.01)


def _kept_norms(cfg, b, tp, sp, rec, prec, cp=1, real=mm.layer_bytes):  # noqa: ANN001, ANN202
    return real(cfg, b, tp, sp, None if rec == "selective" else rec, prec, cp=cp)


MISTAKES = [
    # The first stage: no loss's saves freed before the rise.
    ("rise left out", mock.patch.object(memory, "dropped_norms_rise", lambda *a: 0.0), "mla pp2"),
    ("depths' norms kept", mock.patch.object(mm, "layer_bytes", _kept_norms), "mtp"),
]


@pytest.mark.parametrize("mistake,patch,name", MISTAKES, ids=[m[0] for m in MISTAKES])
def test_a_mistaken_layernorm_count_is_caught(mistake, patch, name):
    """Each moves the gap off the run without layernorm (the figures: bench/RESULTS.md)."""
    without = _gaps(name, False)
    nproc, kw = _flags(name, True)
    _gaps(name, True)  # the ranks, run without the mistake
    with patch:
        ranks = predicted_and_held(nproc, kw, ranks=_HELD[name, True])
    rel = max(abs(h["saved_peak"] / (w["saved"] + c) - 1) for h, w, c in ranks)
    gaps = [h["saved_peak"] - w["saved"] - c for h, w, c in ranks]
    print(mistake, f"{rel:.2%}")
    assert gaps != without, (mistake, gaps)


@pytest.mark.parametrize("extra", [MLA_ARGV, "--mtp-num-layers 1"], ids=["mla", "mtp"])
def test_the_cli_plans_layernorm_recomputation_with_them(extra, capsys):
    """No longer refused: planned, the layouts recomputing layernorm alone."""
    argv = f"{ARGV} {extra} --recompute-activations --recompute-modules layernorm"
    assert megart_main(argv.split()) == 0
    found = json.loads(capsys.readouterr().out)["candidates"]
    assert found and all(c["layout"]["recompute"] == "selective" for c in found)
