"""megart plan's memory model against real megart train ranks (CPU, shared-memory transport):
parameter, gradient and optimizer bytes exactly, and the activations autograd saves at the
peak (torch's saved-tensor hooks) within 1% (the issue asks 10%; the count is exact but for
the embedding's few bytes per held pair on interleaved stages and the vocabulary-padding mask,
which only the last tensor-parallel rank saves)."""

from __future__ import annotations

import pytest

from megart.launcher import launch
from megart.plan.estimate import Layout, estimate, layout_config, rank_memory
from megart.plan.hardware import load_profile
from megart.training.config import TrainConfig
from plan_workers import held_bytes

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

# (name, processes, model, layout flags)
CASES = [
    ("tp2", 2, SMALL, dict(tensor_model_parallel_size=2, micro_batch_size=2)),
    (
        "tp2 sp selective",
        2,
        SMALL,
        dict(
            tensor_model_parallel_size=2,
            sequence_parallel=True,
            recompute_granularity="selective",
            micro_batch_size=2,
        ),
    ),
    ("pp2 1f1b", 2, SMALL, dict(pipeline_model_parallel_size=2, micro_batch_size=1)),
    (
        "pp2 interleaved",
        2,
        SMALL,
        dict(
            pipeline_model_parallel_size=2,
            num_layers_per_virtual_pipeline_stage=1,
            micro_batch_size=2,
        ),
    ),
    (
        "pp2 full recompute",
        2,
        SMALL,
        dict(pipeline_model_parallel_size=2, recompute_granularity="full", micro_batch_size=2),
    ),
    (
        "dp2 distributed optimizer",
        2,
        SMALL,
        dict(use_distributed_optimizer=True, micro_batch_size=2),
    ),
    ("llama-style tp2", 2, LLAMA, dict(tensor_model_parallel_size=2, micro_batch_size=4)),
    # 16-bit autocast: the residual stream stays fp32, the rest is bf16. Tokens per microbatch
    # (128) differ from every weight dimension (see plan_workers.SavedBytes).
    ("pp2 bf16", 2, SMALL, dict(pipeline_model_parallel_size=2, bf16=True, micro_batch_size=4)),
    (
        "pp2 x dp2 distributed optimizer",
        4,
        SMALL,
        dict(pipeline_model_parallel_size=2, use_distributed_optimizer=True, micro_batch_size=1),
    ),
]


def _layout(c: TrainConfig, world: int) -> Layout:
    dp = world // (c.tp * c.pp)
    return Layout(
        c.tp,
        c.pp,
        dp,
        c.chunks,
        c.micro_batch_size,
        c.sequence_parallel,
        c.gpt_config().recompute_granularity,
        c.use_distributed_optimizer,
    )


@pytest.mark.parametrize("name,nproc,model,flags", CASES, ids=[c[0] for c in CASES])
def test_predicted_bytes_are_what_a_rank_holds(name, nproc, model, flags):
    kw = {**model, **flags}
    config = TrainConfig(**kw)
    layout = _layout(config, nproc)
    # The in-flight counts come from the schedule simulator, as the planner uses them.
    plan = estimate(config, layout, load_profile("a100-80gb"))
    c = layout_config(config, layout)
    for held in launch(held_bytes, nproc, kw, timeout=300):
        r = held["pp_rank"]
        want = rank_memory(c, layout, layout.dp, r, plan.peak_in_flight[r], dp_rank=held["dp_rank"])
        for part in ("parameters", "gradients", "optimizer"):
            assert want[part] == held[part], (name, held, part, want[part])
        assert held["saved_peak"] == pytest.approx(want["saved"], rel=0.01), (name, held, want)
        assert held["saved_after"] == 0  # the measure sees every saved tensor released
