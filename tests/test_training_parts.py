"""Pieces of the trainer: data-parallel gradient buckets, the learning-rate schedule, the FLOPs
formula and the built-in corpus."""

import math

import pytest
import torch

import pipeline_workers as pw
from megart.launcher import launch
from megart.training.data import TokenDataset, builtin_corpus
from megart.training.flops import iteration_flops, parameter_count
from megart.training.lr import learning_rate


@pytest.mark.parametrize("bucket_bytes", [1 << 30, 700])
def test_data_parallel_buckets_average_like_one_process(bucket_bytes):
    m, dp = 2, 2
    ref_losses, ref_grads = pw.reference(m * dp)  # the mean over all m * dp microbatches
    results = launch(pw.data_parallel_grads, dp, m, bucket_bytes, timeout=120)
    for grads, n_buckets in results:
        assert (n_buckets == 1) == (bucket_bytes == 1 << 30)
        for name, g in grads.items():
            torch.testing.assert_close(g, ref_grads[name], rtol=1e-12, atol=1e-14)


def test_learning_rate_warms_up_then_follows_a_cosine():
    lrs = [learning_rate(i, 1.0, 0.1, 10, 110) for i in range(120)]
    assert lrs[0] == 0.0 and lrs[1] == pytest.approx(0.1) and lrs[9] == pytest.approx(0.9)
    assert lrs[10] == pytest.approx(1.0)  # Megatron's: warm-up from 0 reaches lr at n = W
    assert lrs[60] == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 0.5)))
    assert lrs[110] == lrs[119] == 0.1
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:], strict=False))


def test_flops_formula_matches_the_papers_table_1_and_the_per_token_form():
    # SC21 Table 1, first row: 1.7B parameters from 24 layers, h 2304, V 51200, s 2048.
    b, s, l, h, v = 512, 2048, 24, 2304, 51200
    p = parameter_count(l, h, v, s)
    assert p == pytest.approx(1.7e9, rel=0.03)
    per_token = iteration_flops(b, s, l, h, v, causal=False) / (b * s)  # the paper's count
    # 6P + 12 l h s (the nanoGPT / PaLM form) once the parameters that cost no matrix FLOPs
    # (position embeddings: h s; biases and norms: 13 l h) are taken out of P.
    assert per_token == pytest.approx(6 * (p - h * s - 13 * l * h) + 12 * l * h * s, rel=1e-12)
    # Full recomputation adds one forward of the layers (not of the logit layer).
    extra = iteration_flops(b, s, l, h, v, recompute=True, causal=False) / (b * s) - per_token
    assert extra == pytest.approx(24 * l * h * h + 4 * l * h * s, rel=1e-12)


def test_builtin_corpus_is_deterministic_and_batches_are_a_function_of_the_iteration():
    tokens = builtin_corpus(1 << 20)
    assert len(tokens) == 1 << 20 and tokens.max() < 256
    ds = TokenDataset(tokens, 32)
    x1, y1 = ds.global_batch(seed=3, iteration=7, size=4)
    x2, y2 = ds.global_batch(seed=3, iteration=7, size=4)
    assert torch.equal(x1, x2) and torch.equal(x1[:, 1:], y1[:, :-1])
    assert not torch.equal(x1, ds.global_batch(seed=3, iteration=8, size=4)[0])


@pytest.mark.parametrize("shard", [False, True])
def test_gradients_reduced_in_bf16_are_the_average_of_bf16_copies(shard):
    """--grad-reduce-in-bf16: each rank's sums go over the wire as bf16 and the average comes
    back into the buffer of the parameters' dtype (this rank's slice of it with the
    distributed optimizer): bf16 rounding of the inputs and of the result, nothing more."""
    ranks = launch(pw.bf16_wire_buckets, 2, shard, timeout=120)
    bf16 = torch.bfloat16
    for r in ranks:
        assert r["wire"] and set(r["wire"]) == {bf16}
        for k, (start, end) in enumerate(r["ranges"]):
            inputs = [q["before"][k][start:end].to(bf16).double() for q in ranks]
            want = (sum(inputs) / 2).to(bf16).double()
            got = r["after"][k][start:end]
            assert got.dtype == r["before"][k].dtype  # the buffer keeps its dtype
            # Within one bf16 rounding of the mean of the rounded inputs (the transport may
            # round its sum once more): 2^-8 relative.
            torch.testing.assert_close(got.double(), want, rtol=2**-8, atol=1e-30)
    exact = (ranks[0]["before"][0] + ranks[1]["before"][0]) / 2
    start, end = ranks[0]["ranges"][0]
    assert not torch.equal(ranks[0]["after"][0][start:end], exact[start:end])  # bf16 was used
