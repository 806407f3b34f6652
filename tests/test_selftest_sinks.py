"""megart selftest's attention-sink check (megart.selftest.sinks): attention with a sink as a
layer runs it, causal and under a window's bias, against the written-out definition in
float64. On this machine's CPU it passes; the sink counted twice fails it. On a GPU the same
check runs in bf16, fp16 and fp32 (the flash and memory-efficient kernels)."""

import math

import pytest
import torch

from megart.models import sinks as sink_module
from megart.selftest import sinks

GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


def test_both_cases_are_checked_and_pass_on_the_cpu():
    checks = sinks.check_sinks(torch.device("cpu"))
    assert [c.name for c in checks] == [
        "attention sink causal float32",
        "attention sink window 100 float32",
    ]
    for c in checks:
        assert c.status == "pass" and c.error < 1e-5, c


def test_a_sink_counted_twice_fails_the_check(monkeypatch):
    real = sink_module.SinkAttention.apply

    def twice(q, k, v, sink, *rest):
        return real(q, k, v, sink + math.log(2), *rest)

    monkeypatch.setattr(sink_module.SinkAttention, "apply", twice)
    for c in sinks.check_sinks(torch.device("cpu")):
        assert c.status == "fail", c


@GPU
def test_the_check_passes_on_this_gpu():
    for c in sinks.check_sinks(torch.device("cuda")):
        assert c.status == "pass", c
