"""The deepseek mode of tests/sweep.py: DeepSeek-style model parts on the sweep's layouts.

A drawn model gets multi-latent attention (with plain rope or its own YaRN), YaRN on the other
attention, attention sinks (--softmax-type off-by-one or learnable, not with MLA, which refuses
them) and multi-token prediction (MoE depths where the model has experts) at times, with the
flags each refuses beside it taken out, so that the draws train rather than stop at a refusal.
Context parallelism (each --cp-comm-type) is drawn half the time, and some draws resume, in
another layout, from a store written in Megatron-LM's torch or torch_dist format (MTP's depths
there dense and on one pipeline stage: megart refuses the rest by name)."""

from __future__ import annotations

import random

# The model flags multi-latent attention refuses beside it (models.mla_checks).
_NOT_WITH_MLA = ("group_query_attention", "num_query_groups", "kv_channels", "window_size",
                 "window_attn_skip_freq")  # fmt: skip
# And multi-token prediction (models.mtp_checks): windows (its depths take experts since
# the last decoder layer's kind is theirs).
_NOT_WITH_MTP = ("window_size", "window_attn_skip_freq")
# The chances of context parallelism (the shared layout draw gives it about 1 in 6) and of a
# resume through Megatron-LM's formats; FORMATS: those formats.
CP, RESUME = 0.5, 0.4
FORMATS = ("torch", "torch_dist")
# The flags of a pipeline of several stages, taken out where a layout is made one stage.
_PIPELINE = ("num_layers_per_virtual_pipeline_stage", "pipeline_schedule",
             "decoder_first_pipeline_num_layers")  # fmt: skip


def parts(rng: random.Random, model: dict) -> None:
    """Adds DeepSeek-style parts to ``model`` (the sweep's drawn flags), in place."""
    model["position_embedding_type"] = "rope"  # MTP under pp refuses learned positions
    if rng.random() < 0.5:
        for flag in _NOT_WITH_MLA:
            model.pop(flag, None)
        model.update(multi_latent_attention=True, rope_type="rope", kv_lora_rank=12,
                     qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=6)  # fmt: skip
        if rng.random() < 0.5:
            model["q_lora_rank"] = 16
        if rng.random() < 0.5:  # MLA's own YaRN (Megatron's default for it)
            model.update(rope_type="yarn", rotary_scaling_factor=rng.choice([2.0, 40.0]),
                         mscale=1.0, mscale_all_dim=rng.choice([0.0, 1.0]))  # fmt: skip
    else:
        if rng.random() < 0.6:
            model.update(position_embedding_type="yarn",
                         rotary_scaling_factor=rng.choice([2.0, 4.0]),
                         yarn_original_max_position_embeddings=8)  # fmt: skip
            if rng.random() < 0.5:
                model.update(mscale=rng.choice([0.7, 1.0]), mscale_all_dim=rng.choice([0.0, 0.5]))
        if rng.random() < 0.7:  # attention sinks (megart.models.sinks)
            model["softmax_type"] = rng.choice(["off-by-one", "learnable"])
    if rng.random() < 0.6:
        for flag in _NOT_WITH_MTP:
            model.pop(flag, None)
        model.update(mtp_num_layers=rng.choice([1, 2]),
                     mtp_loss_scaling_factor=rng.choice([0.1, 0.3]))  # fmt: skip
    if rng.random() < 0.5:  # weights large enough that rope's kind moves the curve
        model["init_method_std"] = 0.2


def layout(rng: random.Random, draw_layout, layers: int) -> tuple[int, dict, int]:
    """``draw_layout(rng, layers)``'s (ranks, flags, data-parallel size), redrawn until it has
    context parallelism with the chance CP."""
    want = rng.random() < CP
    while True:
        ranks, flags, dp = draw_layout(rng, layers)
        if (flags["context_parallel_size"] > 1) == want:
            return ranks, flags, dp


def resumes(rng: random.Random, model: dict) -> bool:
    """Whether this draw resumes through Megatron-LM's formats (chance RESUME); if so, the
    depths of multi-token prediction beside experts are taken out of ``model`` (megart does
    not write MoE depths there, and the mode draws dense depths more often than not)."""
    if rng.random() >= RESUME:
        return False
    if model.get("num_experts"):
        model.pop("mtp_num_layers", None)
        model.pop("mtp_loss_scaling_factor", None)
    return True


def one_stage(model: dict, flags: dict, ranks: int) -> int:
    """Where ``model`` has MTP depths, ``flags`` (a layout of ``ranks`` ranks) made one pipeline
    stage, where megart writes the depths in both Megatron-LM formats (on several, torch_dist
    only, untied and without the distributed optimizer); the ranks."""
    pp = flags["pipeline_model_parallel_size"]
    if not model.get("mtp_num_layers") or pp == 1:
        return ranks
    for flag in _PIPELINE:
        flags.pop(flag, None)
    flags["pipeline_model_parallel_size"] = 1
    return ranks // pp
