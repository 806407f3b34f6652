"""Context parallelism (--context-parallel-size): each sequence split over cp ranks as
Megatron-Core splits it (2 cp chunks, rank r holding r and 2 cp - 1 - r), keys and values
all-gathered over the group, positions global. The split is Megatron-Core's
get_batch_on_this_cp_rank's; attention and whole models at cp2 and cp4 are the one-process ones
(float64), and so are whole models at tp2 x cp2 with sequence parallelism; `megart train` at
cp2 x dp2 (distributed optimizer), cp2 x pp2, and tp2 x cp2 (x pp2) with sequence parallelism
follows the one-process loss curve, and a cp2 checkpoint resumes under cp1 on it; sequence
lengths are Megatron's; what cp cannot do yet is refused by name."""

import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import cp_workers as cw
import megatron_workers as mw
import train_workers as tw
from megart import ConfigError
from megart.launcher import launch
from megart.models.context_parallel import (
    blockwise_attention,
    causal_mask,
    masked_attention,
    split_for_cp,
)
from megart.parallel import make_layout

REL = 5e-6  # as test_uneven_train: a lost reduction or a wrong position moves the loss far more
F64_REL = 1e-12
# This file's training runs use the all-gather exchange (--cp-comm-type all_gather); the
# ring's, the default, are tests/test_context_parallel_ring.py's.
BASE = dict(vocab_size=300, seq_length=16, hidden_size=32, num_layers=2, num_attention_heads=4,
            init_std=0.5, cp_comm_type="all_gather")  # fmt: skip
LLAMA = dict(position_embedding="rotary", normalization="rmsnorm", activation="swiglu",
             num_query_groups=2, untie_embeddings_and_output_weights=True)  # fmt: skip
# The training runs: Llama-style (rope), 4 iterations, a checkpoint after 2. Weights drawn wider
# than the default 0.02, whose near-uniform attention hides positions: rope at each rank's local
# positions moves this curve by 1e-2 relative, the default's by 1e-6.
TRAIN = dict(vocab_size=300, train_iters=4, position_embedding_type="rope", init_method_std=0.2,
             normalization="RMSNorm", swiglu=True, cp_comm_type="all_gather")  # fmt: skip


@settings(max_examples=25, deadline=None)
@given(
    cp=st.integers(1, 4),
    per_chunk=st.integers(1, 3),
    batch=st.integers(1, 3),
    extra=st.lists(st.integers(1, 3), max_size=2),
)
def test_the_split_is_megatron_cores_get_batch_on_this_cp_rank(cp, per_chunk, batch, extra):
    from megatron.core import parallel_state, utils

    seq = 2 * cp * per_chunk
    tokens = torch.arange(batch * seq * int(torch.tensor(extra).prod())).reshape(batch, seq, *extra)
    for r in range(cp):
        # Megatron-Core reads its parallel state without a group; patched to this cp rank.
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(parallel_state, "get_context_parallel_world_size", lambda: cp)
            mp.setattr(parallel_state, "get_context_parallel_rank", lambda r=r: r)
            want = utils.get_batch_on_this_cp_rank({"tokens": tokens.clone()})["tokens"]
        assert torch.equal(split_for_cp(tokens, 1, cp, r), want)
    # Every position is held by exactly one rank.
    held = torch.cat([split_for_cp(torch.arange(seq), 0, cp, r) for r in range(cp)])
    assert sorted(held.tolist()) == list(range(seq))


def test_the_mask_follows_global_positions():
    # cp2 rank 1 holds positions 4..7 and 8..11 of 16; gathered keys are rank 0's then rank 1's.
    keys = [0, 1, 2, 3, 12, 13, 14, 15, 4, 5, 6, 7, 8, 9, 10, 11]
    queries = [4, 5, 6, 7, 8, 9, 10, 11]
    want = torch.tensor([[k <= q for k in keys] for q in queries])
    assert torch.equal(causal_mask(2, 1, 8, None), want)


@settings(max_examples=40, deadline=None)
@given(
    cp=st.sampled_from([2, 3, 4]),
    rank=st.integers(0, 3),
    half=st.sampled_from([1, 2, 5]),
    heads=st.sampled_from([1, 3]),
    seed=st.integers(0, 2**16),
)
def test_the_gpus_blockwise_attention_is_the_masked_one(cp, rank, half, heads, seed):
    """What a GPU runs (each query chunk against the keys up to its end, causal aligned to the
    lower right, with torch's causal bias object) equals what the CPU tests run (one call
    under the explicit mask), outputs and the gradients of q and the gathered k, v, in float64."""
    rank %= cp
    g = torch.Generator().manual_seed(seed)
    local, b, d = 2 * half, 2, 4

    def draw(n: int) -> torch.Tensor:
        return torch.randn(b, heads, n, d, generator=g, dtype=torch.float64, requires_grad=True)

    q, k, v = draw(local), draw(local * cp), draw(local * cp)
    grad = torch.randn(b, heads, local, d, generator=g, dtype=torch.float64)
    outs = []
    for attend in (masked_attention, blockwise_attention):
        y = attend(q, k, v, cp, rank, 0.0)
        outs.append((y, *torch.autograd.grad(y, (q, k, v), grad)))
    for want, got in zip(*outs, strict=True):
        assert torch.allclose(got, want, rtol=F64_REL, atol=1e-13)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (the flash kernels)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_blockwise_attention_on_a_gpu_is_the_masked_one_in_float64(dtype):
    """On CUDA (where torch's causal bias object reaches the flash kernels) each rank's blockwise
    attention at cp4 against the masked one on the CPU in float64: outputs and gradients."""
    g = torch.Generator().manual_seed(7)
    cp, local, b, heads, d = 4, 256, 2, 4, 64
    shapes = [(b, heads, local, d), (b, heads, local * cp, d), (b, heads, local * cp, d)]
    q, k, v = (torch.randn(s, generator=g, dtype=torch.float64) for s in shapes)
    grad = torch.randn(b, heads, local, d, generator=g, dtype=torch.float64)
    tol = 2e-2 if dtype == torch.bfloat16 else 2e-3  # flash accumulates in fp32 either way
    for rank in range(cp):
        got, want = [], []
        for attend, device, kind in ((blockwise_attention, "cuda", dtype),
                                     (masked_attention, "cpu", torch.float64)):  # fmt: skip
            x = [t.to(device, kind).requires_grad_() for t in (q, k, v)]
            y = attend(*x, cp, rank, 0.0)
            grads = torch.autograd.grad(y, x, grad.to(device, kind))
            (got if device == "cuda" else want).extend([y, *grads])
        for a, w in zip(got, want, strict=True):
            assert (a.double().cpu() - w).abs().max() <= tol * w.abs().max(), rank


# The float64 equalities hold for both exchanges of keys and values (the ring's own checks are
# tests/test_context_parallel_ring.py's).
COMMS = pytest.mark.parametrize("comm", ["all_gather", "p2p"])


@COMMS
def test_attention_and_models_at_cp2_and_cp4_are_the_one_process_ones(comm):
    """float64: one layer's attention (rope, GQA), a GPT-2-style model (learned positions)
    and a Llama-style one; outputs, input gradients and weight gradients."""
    base = dict(BASE, cp_comm_type=comm)
    attention = dict(base, position_embedding="rotary", num_query_groups=2)
    models = [base, dict(base, **LLAMA)]
    per_rank = launch(cw.against_one_process, 4, attention, models, timeout=120)
    worst = {k: max(r[k] for r in per_rank if k in r) for k in per_rank[0] | per_rank[-1]}
    assert len(worst) == 2 * (2 + 4 + 2 * 2)
    assert max(worst.values()) < F64_REL, worst


@COMMS
def test_tp2_x_cp2_with_sequence_parallelism_is_the_one_process_model(comm):
    """float64, GPT-2-style (learned positions) and Llama-style (rope, GQA): each cp rank's
    s/cp tokens split over t outside attention and the MLP; loss and every gradient."""
    base = dict(BASE, cp_comm_type=comm)
    per_rank = launch(cw.tp_sp_against_one_process, 4, [base, dict(base, **LLAMA)], timeout=120)
    worst = {k: max(r[k] for r in per_rank) for k in per_rank[0]}
    assert len(worst) == 2 + 28 + 27  # two losses; every gradient of gpt-2's 28, llama's 27
    assert max(worst.values()) < F64_REL, worst


def _losses(nproc, **kw):
    return launch(cw.losses, nproc, {**TRAIN, **kw}, timeout=300)[0]


@pytest.fixture(scope="module")
def straight():
    return _losses(1)


@pytest.fixture(scope="module")
def cp2_checkpoint(tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("cp") / "ckpt"
    layout = dict(context_parallel_size=2, use_distributed_optimizer=True)
    return ckpt, _losses(4, save=str(ckpt), save_interval=2, **layout)


def test_cp2_x_dp2_with_the_distributed_optimizer_follows_the_one_process_curve(
    straight, cp2_checkpoint
):
    _, losses = cp2_checkpoint
    assert losses == pytest.approx(straight, rel=REL, abs=0)


def test_cp2_x_pp2_follows_the_one_process_curve(straight):
    layout = dict(context_parallel_size=2, pipeline_model_parallel_size=2)
    assert _losses(4, train_iters=3, **layout) == pytest.approx(straight[:3], rel=REL, abs=0)


@pytest.mark.parametrize("schedule", ["zb-h1", "zb-v"])
def test_cp2_x_pp2_under_the_zero_bubble_schedules_follows_the_one_process_curve(
    straight, schedule
):
    """The split backward (I, then W from the deferred inputs and output gradients) under
    context parallelism: the K/V gather's reduce-scatter runs in I."""
    layout = dict(context_parallel_size=2, pipeline_model_parallel_size=2)
    losses = _losses(4, train_iters=3, pipeline_schedule=schedule, **layout)
    assert losses == pytest.approx(straight[:3], rel=REL, abs=0)


SP = dict(tensor_model_parallel_size=2, context_parallel_size=2, sequence_parallel=True)


def test_tp2_x_cp2_with_sequence_parallelism_follows_the_one_process_curve(straight):
    assert _losses(4, **SP) == pytest.approx(straight, rel=REL, abs=0)


def test_tp2_x_cp2_x_pp2_with_sequence_parallelism_follows_the_one_process_curve(straight):
    layout = dict(SP, pipeline_model_parallel_size=2)
    assert _losses(8, train_iters=3, **layout) == pytest.approx(straight[:3], rel=REL, abs=0)


def test_a_cp2_checkpoint_resumes_under_cp1_on_the_curve(straight, cp2_checkpoint):
    ckpt, _ = cp2_checkpoint
    resumed = _losses(1, load=str(ckpt), ckpt_step=2, use_distributed_optimizer=True)
    assert resumed == pytest.approx(straight[2:], rel=REL, abs=0)


def test_the_grid_puts_cp_between_tp_and_dp():
    layout = make_layout(16, tp=2, pp=2, cp=2)  # Megatron's tp-cp-dp-pp: dp = 2
    assert layout.group_of("cp", 0) == (0, 2)
    assert layout.group_of("dp", 0) == (0, 4)
    assert layout.group_of("dp_cp", 0) == (0, 2, 4, 6)
    assert layout.group_of("pp", 0) == (0, 8)
    assert layout.group_of("mp", 2) == (2, 3, 10, 11)
    assert [layout.cp_rank_of(r) for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]


@pytest.mark.parametrize(
    "kw, world, says",
    [
        (dict(seq_length=20), 3, "--seq-length 20 is not divisible by 2 x --context-parallel-size"
         " 3 = 6 (context parallelism cuts each sequence into 2 cp equal chunks); use "
         "--seq-length 18 or 24"),
        (dict(), 3, "tensor-parallel 1 x context-parallel 2 (--context-parallel-size 2) x"),
    ],
)  # fmt: skip
def test_what_cp_cannot_do_is_refused_by_name(kw, world, says):
    cp = 3 if "seq_length" in kw else 2
    with pytest.raises(ConfigError, match="context") as e:
        tw.tiny(**{"context_parallel_size": cp, **kw}).check(world)
    assert says in str(e.value)


@settings(max_examples=300, deadline=None)
@given(seq=st.integers(1, 100), tp=st.sampled_from([1, 2, 3, 4, 8]), cp=st.integers(1, 6))
def test_sequence_parallelism_under_cp_takes_megatrons_lengths(seq, tp, cp):
    """Megatron-LM's rules: s a multiple of 2 cp (arguments.py, with cp > 1), and each cp rank's
    s/cp tokens a multiple of t (the scatter to the sequence-parallel region asserts it). A
    refusal names lengths that pass."""
    world = tp * cp
    config = tw.tiny(seq_length=seq, tensor_model_parallel_size=tp, context_parallel_size=cp,
                     sequence_parallel=True, num_attention_heads=24, hidden_size=48)  # fmt: skip
    megatron = (cp == 1 or seq % (2 * cp) == 0) and (seq // cp) % tp == 0
    try:
        config.check(world)
    except ConfigError as e:
        assert not megatron, str(e)
        fits = re.search(r"use --seq-length (\d+)(?: or (\d+))?", str(e)).groups()
        for n in filter(None, fits):
            tw.tiny(**{**config.__dict__, "seq_length": int(n)}).check(world)
    else:
        assert megatron


def test_the_sequence_parallel_refusal_names_the_rank_s_tokens():
    with pytest.raises(ConfigError) as e:
        tw.tiny(seq_length=20, **dict(SP, tensor_model_parallel_size=4)).check(8)
    assert str(e.value) == (
        "--sequence-parallel splits each context-parallel rank's --seq-length 20 / "
        "--context-parallel-size 2 = 10 tokens over tensor-parallel size 4 "
        "(--tensor-model-parallel-size); it must divide: use --seq-length 16 or 24 (a multiple "
        "of 8)"
    )


def test_the_cli_refuses_once_before_any_work():
    status, out = mw.run_cli(["--context-parallel-size", "3", "--seq-length", "64"])
    assert status == 2 and "iteration" not in out
    assert "--seq-length 64 is not divisible by 2 x --context-parallel-size 3" in out
    assert out.count("error") == 1, out
