"""The small GPTs and the check of tests/test_plan_memory.py, shared with the plan tests that
build on them and with tests/sweep.py's memory mode: megart plan's memory for a rank against
what a real megart train rank holds."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from megart import schedule as sched
from megart.launcher import launch
from megart.plan import activations as act
from megart.plan.estimate import estimate
from megart.plan.hardware import load_profile
from megart.plan.holding import peaks
from megart.plan.layout import ZERO_BUBBLE, Layout, layout_config
from megart.plan.memory import precision, rank_memory
from megart.plan.mtp_memory import mtp_weight_grad_bytes
from megart.training.config import TrainConfig
from plan_workers import deferred_bytes, held_bytes

SMALL = dict(
    num_layers=4,
    hidden_size=64,
    num_attention_heads=4,
    seq_length=32,
    vocab_size=256,
    global_batch_size=8,
    train_iters=2,
    lr_warmup_iters=1,
    eval_iters=0,
    # No dropout unless a case asks: attention dropout sends a CPU to the math kernel (s x s
    # matrices a GPU's flash kernel does not keep), and hidden dropout is a case of its own.
    hidden_dropout=0.0,
    attention_dropout=0.0,
)
LLAMA = dict(
    SMALL,
    normalization="RMSNorm",
    position_embedding_type="learned_absolute",
    swiglu=True,
    disable_bias_linear=True,
    untie_embeddings_and_output_weights=True,
    group_query_attention=True,
    num_query_groups=2,
    vocab_size=300,  # padded: the output layer masks the padding
)
# Llama proper: rope besides RMSNorm, SwiGLU, grouped queries, no biases and an untied output
# layer, in bf16. 96 tokens per microbatch (3 x 32): no weight's dimension (see SavedBytes).
LLAMA_ROPE = dict(LLAMA, position_embedding_type="rope", bf16=True, global_batch_size=12)


def _layout(c: TrainConfig, world: int) -> Layout:
    """The planner's layout of a megart train config (uneven stages included)."""
    dp = world // (c.tp * c.pp * c.context_parallel_size)
    return Layout(
        c.tp,
        c.pp,
        dp,
        c.chunks,
        c.micro_batch_size,
        c.sequence_parallel,
        c.gpt_config().recompute_granularity,
        c.use_distributed_optimizer,
        c.pipeline_schedule,
        c.decoder_first_pipeline_num_layers,
        c.decoder_last_pipeline_num_layers,
        c.context_parallel_size,
        ep=c.expert_model_parallel_size,
    )


def cpu_dropout_masks(config: TrainConfig, layout: Layout, pp_rank: int, pairs: int) -> float:
    """What a CPU rank keeps beyond the plan, which counts a GPU's fused dropout (a bool mask,
    1 byte per element): a CPU's dropout keeps its mask in the activations' dtype. Two masks
    per layer (the attention's and the MLP's outputs, 16-bit under autocast) and the
    embedding's on the first stage (the residual stream's dtype), each this rank's slice of
    the sequence with sequence parallelism; ``pairs`` (microbatch, chunk) pairs in flight; and
    multi-token prediction's depths' three each on the last stage."""
    if config.hidden_dropout == 0:
        return 0.0
    prec = precision(config, "megart")
    cfg = config.gpt_config()
    tokens = cfg.seq_length * layout.micro_batch / (layout.tp if layout.sequence_parallel else 1)
    layers = layout.layer_counts(cfg.num_layers)[pp_rank] // layout.chunks
    extra = 2 * layers * (prec.other - 1)
    if pp_rank == 0:
        extra += prec.residual - 1
    # Multi-token prediction's depths on the last stage, once (plan.mtp_memory): each its
    # embedding's mask and its layer's two.
    depths = (cfg.mtp_num_layers or 0) * (pp_rank == layout.pp - 1)
    once = depths * (prec.residual - 1 + 2 * (prec.other - 1))
    return (pairs * extra + once) * tokens * cfg.hidden_size


def predicted_and_held(
    nproc: int,
    kw: dict,
    held_by: Callable[..., dict] = held_bytes,
    args: tuple = (),
    expert_tokens: Callable[[dict], float] = lambda held: 1.0,
    ranks: list[dict] | None = None,
) -> list[tuple[dict, dict, float]]:
    """Per rank of a real ``nproc``-rank run of ``kw``: what it held (``held_by(kw, *args)``,
    plan_workers.held_bytes by default; ``ranks``: those of a run made already), what megart
    plan predicts for that rank (rank_memory; under expert parallelism with the token copies
    ``expert_tokens(held)`` says that rank's experts got, in k T), and what a CPU keeps beyond
    the plan (cpu_dropout_masks)."""
    config = TrainConfig(**kw)
    layout = _layout(config, nproc)
    # The in-flight counts come from the schedule simulator, as the planner uses them.
    plan = estimate(config, layout, load_profile("a100-80gb"))
    c = layout_config(config, layout)
    order = sched.build(layout.kind, layout.pp, c.microbatches(layout.dp), layout.chunks)
    out = []
    if ranks is None:
        ranks = launch(held_by, nproc, kw, *args, timeout=300)
    for held in ranks:
        r = held["pp_rank"]
        pairs = plan.peak_in_flight[r]
        if layout.kind in ZERO_BUBBLE:  # the most pairs between F and I
            pairs = peaks(order, 1.0, [[0.0] * layout.chunks] * layout.pp)[r].activations
        # Under context parallelism the optimizer shards over d x cp ranks: the rank's index
        # there (rank_memory's dp_rank).
        want = rank_memory(c, layout, layout.dp, r, pairs, dp_rank=held["dp_cp_rank"],
                           expert_tokens=expert_tokens(held))  # fmt: skip
        out.append((held, want, cpu_dropout_masks(config, layout, r, pairs)))
    return out


def assert_rank_matches(
    name: str, held: dict, want: dict, cpu: float, exact: bool, rel: float = 0.01
) -> None:
    """A rank's parameter, gradient and optimizer bytes equal to the prediction's, its peak of
    saved bytes too (``exact``) or within ``rel``, and nothing saved once the iteration is
    over."""
    for part in ("parameters", "gradients", "optimizer"):
        assert want[part] == held[part], (name, held, part, want[part])
    if exact:
        assert held["saved_peak"] == want["saved"] + cpu, (name, held, want)
    else:
        assert held["saved_peak"] == pytest.approx(want["saved"] + cpu, rel=rel)
    assert held["saved_after"] == 0


def deferred_and_predicted(
    nproc: int, kw: dict, ranks: list[dict] | None = None
) -> list[tuple[int, float]]:
    """Per rank of a real ``nproc``-rank run of ``kw`` under a zero-bubble schedule: the most
    bytes it kept between its Is and Ws (plan_workers.deferred_bytes; ``ranks``: those of a
    run made already), and what megart plan says it keeps at its peak of them (the layers'
    activations.weight_grad_bytes, the last stage's output_weight_grad_bytes and the
    prediction depths' mtp_weight_grad_bytes)."""
    config = TrainConfig(**kw)
    layout = _layout(config, nproc)
    c = layout_config(config, layout)
    cfg = c.gpt_config()
    t, p, v, b, cp = layout.tp, layout.pp, layout.chunks, layout.micro_batch, layout.cp
    prec = precision(c, "megart")
    per_chunk = act.weight_grad_bytes(cfg, b, t, prec, cp) * (cfg.num_layers // (p * v))
    out = act.output_weight_grad_bytes(cfg, b, t, prec, cp)
    out += mtp_weight_grad_bytes(cfg, b, t, prec, cp)  # the depths', s/cp tokens too
    plan = sched.build(layout.kind, p, c.microbatches(layout.dp), v)
    last = p * v - 1
    grads = [[per_chunk + (out if plan.virtual_stage(q, k) == last else 0) for k in range(v)]
             for q in range(p)]  # fmt: skip
    result = []
    for held in ranks if ranks is not None else launch(deferred_bytes, nproc, kw, timeout=300):
        most = peaks(plan, 0.0, grads)[held["pp_rank"]]  # where the weight gradients peak
        want = most.weight_grads * per_chunk + most.last_stage_weight_grads * out
        result.append((held["peak"], want))
    return result
