"""megart plan's memory model against real megart train ranks (CPU, shared-memory transport):
parameter, gradient and optimizer bytes exactly, and the activations autograd saves at the
peak (torch's saved-tensor hooks) within 1% (the issue asks 10%). The count is exact but for
the vocabulary-padding mask,
which only the last tensor-parallel rank saves, and under bf16 what the planner counts as a
GPU keeps it: CPU's LayerNorm keeps a 16-bit input's mean and rstd in 16 bits where CUDA's
keep fp32 (the fused kernel's CPU reference keeps none), and the 16-bit casts of 1-D weights
(norm weights and biases, the MLP bias before the fused GeLU: O(h) bytes per layer and
microbatch, against O(s b h)) are not counted. Together up to 0.4% here."""

from __future__ import annotations

import pytest

# The small GPTs and _layout are re-exported: the other plan tests import them from here.
from plan_memory_check import (  # noqa: F401 - _layout
    LLAMA,
    LLAMA_ROPE,
    SMALL,
    _layout,
    deferred_and_predicted,
    predicted_and_held,
)

# (name, processes, model, layout flags)
CASES = [
    # --recompute-method/--recompute-num-layers: uniform groups keep one input each and replay
    # the whole group at once; block keeps everything of the layers past the first N.
    (
        "uniform 2",
        1,
        SMALL,
        dict(recompute_granularity="full", recompute_num_layers=2, micro_batch_size=2),
    ),
    (
        "pp2 block 1",
        2,
        SMALL,
        dict(
            pipeline_model_parallel_size=2,
            recompute_granularity="full",
            recompute_method="block",
            micro_batch_size=2,
        ),
    ),
    (
        "tp2 sp block 3 llama rope",
        2,
        LLAMA_ROPE,
        dict(
            tensor_model_parallel_size=2,
            sequence_parallel=True,
            recompute_granularity="full",
            recompute_method="block",
            recompute_num_layers=3,
            micro_batch_size=3,
        ),
    ),
    # --cross-entropy-loss-fusion: the loss keeps the logits (fp32 here, bf16 there) instead
    # of an fp32 softmax; padded vocabulary, tensor-parallel slices.
    (
        "tp2 fused loss",
        2,
        SMALL,
        dict(tensor_model_parallel_size=2, micro_batch_size=2, cross_entropy_loss_fusion=True),
    ),
    (
        "pp2 bf16 fused loss llama-style",
        2,
        # h 96: 64 tokens' [64, V] logits would look like a weight of h 64 (SavedBytes); b 2:
        # the loss's int64 targets are then a copy, not a view of the whole batch's tokens.
        dict(LLAMA, hidden_size=96),
        dict(
            pipeline_model_parallel_size=2,
            bf16=True,
            micro_batch_size=2,
            cross_entropy_loss_fusion=True,
        ),
    ),
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
    # --recompute-modules: layernorm frees the norms' outputs (on pp rank 0 the peak is a
    # norm's output saved until read, or made again in backward with the norm's own saves),
    # mlp keeps the MLP's input only; with sequence parallelism the gathered copies go too.
    (
        "pp2 selective layernorm mlp",
        2,
        SMALL,
        dict(
            pipeline_model_parallel_size=2,
            recompute_granularity="selective",
            recompute_modules=["layernorm", "mlp"],
            micro_batch_size=2,
        ),
    ),
    (
        "llama rope tp2 sp selective all modules",
        2,
        LLAMA_ROPE,
        dict(
            tensor_model_parallel_size=2,
            sequence_parallel=True,
            recompute_activations=True,
            recompute_modules=["core_attn", "layernorm", "mlp"],
            micro_batch_size=3,
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
    # 16-bit autocast: every saved activation bf16, the residual stream too, or with
    # --fp32-residual-connection the stream fp32 and the rest bf16. Tokens per microbatch (128)
    # differ from every weight dimension (see plan_workers.SavedBytes).
    ("pp2 bf16", 2, SMALL, dict(pipeline_model_parallel_size=2, bf16=True, micro_batch_size=4)),
    (
        "pp2 bf16 fp32 residual",
        2,
        SMALL,
        dict(
            pipeline_model_parallel_size=2,
            bf16=True,
            fp32_residual_connection=True,
            micro_batch_size=4,
        ),
    ),
    (
        "tp2 sp bf16 fused norms",
        2,
        SMALL,
        dict(
            tensor_model_parallel_size=2,
            sequence_parallel=True,
            bf16=True,
            fused_layer_norm=True,
            micro_batch_size=4,
        ),
    ),
    (
        "pp2 x dp2 distributed optimizer",
        4,
        SMALL,
        dict(pipeline_model_parallel_size=2, use_distributed_optimizer=True, micro_batch_size=1),
    ),
    # --half-weights: 16-bit weights, fp32 main weights (sharded with the distributed
    # optimizer) beside the moments, and no autocast copies.
    (
        "pp2 bf16 half weights",
        2,
        SMALL,
        dict(pipeline_model_parallel_size=2, bf16=True, half_weights=True, micro_batch_size=4),
    ),
    (
        "pp2 x dp2 bf16 half weights distributed optimizer",
        4,
        SMALL,
        dict(
            pipeline_model_parallel_size=2,
            bf16=True,
            half_weights=True,
            use_distributed_optimizer=True,
            micro_batch_size=2,
        ),
    ),
    # Llama-style with rope, bf16: tp2 (one query group per rank) and pp2 (two per rank, so q
    # is a copy), without and with selective recomputation; hidden dropout on a CPU (see
    # cpu_dropout_masks).
    ("llama rope tp2", 2, LLAMA_ROPE, dict(tensor_model_parallel_size=2, micro_batch_size=3)),
    (
        "llama rope tp2 sp selective",
        2,
        LLAMA_ROPE,
        dict(
            tensor_model_parallel_size=2,
            sequence_parallel=True,
            recompute_granularity="selective",
            micro_batch_size=3,
        ),
    ),
    ("llama rope pp2", 2, LLAMA_ROPE, dict(pipeline_model_parallel_size=2, micro_batch_size=3)),
    (
        "llama rope pp2 selective",
        2,
        LLAMA_ROPE,
        dict(pipeline_model_parallel_size=2, recompute_granularity="selective", micro_batch_size=3),
    ),
    (
        "llama rope tp2 sp hidden dropout",
        2,
        LLAMA_ROPE,
        dict(
            tensor_model_parallel_size=2,
            sequence_parallel=True,
            hidden_dropout=0.1,
            micro_batch_size=3,
        ),
    ),
    # --fp32-residual-connection under SwiGLU: the fp32 norm output enters the gate and up
    # projections once, in 16 bits (one saved copy, as with a 16-bit stream), and with
    # --half-weights the 16-bit embedding's lookup joins the fp32 stream.
    (
        "llama rope tp2 sp fp32 residual",
        2,
        LLAMA_ROPE,
        dict(
            tensor_model_parallel_size=2,
            sequence_parallel=True,
            fp32_residual_connection=True,
            micro_batch_size=3,
        ),
    ),
    (
        "llama rope pp2 half weights fp32 residual",
        2,
        LLAMA_ROPE,
        dict(
            pipeline_model_parallel_size=2,
            half_weights=True,
            fp32_residual_connection=True,
            micro_batch_size=3,
        ),
    ),
    # --kv-channels: heads wider than h / heads (q = 4 x 32 = 128 on h 64, as Qwen3's head_dim
    # 128 on a smaller h), with its query and key norms; and narrower (q = 32), interleaved.
    (
        "qwen3-style tp2 sp kv-channels 32",
        2,
        dict(LLAMA_ROPE, kv_channels=32, qk_layernorm=True),
        dict(tensor_model_parallel_size=2, sequence_parallel=True, micro_batch_size=3),
    ),
    (
        "pp2 interleaved selective kv-channels 8",
        2,
        dict(SMALL, kv_channels=8),
        dict(
            pipeline_model_parallel_size=2,
            num_layers_per_virtual_pipeline_stage=1,
            recompute_granularity="selective",
            micro_batch_size=2,
        ),
    ),
    # Interleaved with full recomputation: little else is saved, so the embedding's saves
    # (token ids, the tp mask) must be charged to the first chunk's held pairs only.
    (
        "llama tp2 pp2 interleaved full bf16",
        4,
        LLAMA,
        dict(
            tensor_model_parallel_size=2,
            pipeline_model_parallel_size=2,
            num_layers_per_virtual_pipeline_stage=1,
            recompute_granularity="full",
            bf16=True,
            micro_batch_size=3,
            global_batch_size=12,
        ),
    ),
    # Zero-bubble: autograd's saves are those of the pairs between F and I (I frees the graph;
    # what W needs is counted apart, below).
    (
        "pp2 zb-h1",
        2,
        SMALL,
        dict(pipeline_model_parallel_size=2, pipeline_schedule="zb-h1", micro_batch_size=1),
    ),
    (
        "pp2 zb-v",
        2,
        SMALL,
        dict(pipeline_model_parallel_size=2, pipeline_schedule="zb-v", micro_batch_size=1),
    ),
]


@pytest.mark.parametrize("name,nproc,model,flags", CASES, ids=[c[0] for c in CASES])
def test_predicted_bytes_are_what_a_rank_holds(name, nproc, model, flags):
    for held, want, cpu in predicted_and_held(nproc, {**model, **flags}):
        for part in ("parameters", "gradients", "optimizer"):
            assert want[part] == held[part], (name, held, part, want[part])
        assert held["saved_peak"] == pytest.approx(want["saved"] + cpu, rel=0.01), (
            name,
            held,
            want,
        )
        assert held["saved_after"] == 0  # the measure sees every saved tensor released


# Zero-bubble schedules: what ranks keep between I and W, against the planner's count of the
# deferred layers' X and dY times the pairs its schedule walk finds held between I and W.
ZB_CASES = [
    # Context parallelism: each rank defers its s/cp tokens' inputs and output gradients.
    (
        "zb-v pp2 cp2 llama-style",
        4,
        LLAMA,
        dict(pipeline_schedule="zb-v", context_parallel_size=2, micro_batch_size=1),
    ),
    ("zb-h1 pp2 bf16", 2, SMALL, dict(pipeline_schedule="zb-h1", bf16=True, micro_batch_size=2)),
    ("zb-v pp2 llama-style", 2, LLAMA, dict(pipeline_schedule="zb-v", micro_batch_size=1)),
    (
        "zb-v pp2 llama-style kv-channels 32",
        2,
        dict(LLAMA, kv_channels=32),
        dict(pipeline_schedule="zb-v", micro_batch_size=1),
    ),
    (
        "zb-h1 pp2 tp2 sp full recompute",
        4,
        SMALL,
        dict(
            pipeline_schedule="zb-h1",
            tensor_model_parallel_size=2,
            sequence_parallel=True,
            recompute_granularity="full",
            micro_batch_size=2,
        ),
    ),
]


@pytest.mark.parametrize("name,nproc,model,flags", ZB_CASES, ids=[c[0] for c in ZB_CASES])
def test_weight_gradient_bytes_held_between_i_and_w(name, nproc, model, flags):
    kw = {**model, **flags, "pipeline_model_parallel_size": 2}
    for held, want in deferred_and_predicted(nproc, kw):
        assert want > 0 and held == pytest.approx(want, rel=0.01), (name, held, want)
