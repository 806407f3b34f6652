"""The deepseek mode of tests/sweep.py: DeepSeek-style model parts on the sweep's layouts.

A drawn model gets multi-latent attention (with plain rope or its own YaRN), YaRN on the other
attention, and multi-token prediction (MoE depths where the model has experts) at times, with
the flags each refuses beside it taken out, so that the draws train rather than stop at a
refusal."""

from __future__ import annotations

import random

# The model flags multi-latent attention refuses beside it (models.mla_checks).
_NOT_WITH_MLA = ("group_query_attention", "num_query_groups", "kv_channels", "window_size",
                 "window_attn_skip_freq")  # fmt: skip
# And multi-token prediction (models.mtp_checks): windows (its depths take experts since
# the last decoder layer's kind is theirs).
_NOT_WITH_MTP = ("window_size", "window_attn_skip_freq")


def parts(rng: random.Random, model: dict) -> None:
    """Adds DeepSeek-style parts to ``model`` (the sweep's drawn flags), in place."""
    model["position_embedding_type"] = "rope"  # MTP under pp refuses learned positions
    if rng.random() < 0.6:
        for flag in _NOT_WITH_MLA:
            model.pop(flag, None)
        model.update(multi_latent_attention=True, rope_type="rope", kv_lora_rank=12,
                     qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=6)  # fmt: skip
        if rng.random() < 0.5:
            model["q_lora_rank"] = 16
        if rng.random() < 0.5:  # MLA's own YaRN (Megatron's default for it)
            model.update(rope_type="yarn", rotary_scaling_factor=rng.choice([2.0, 40.0]),
                         mscale=1.0, mscale_all_dim=rng.choice([0.0, 1.0]))  # fmt: skip
    elif rng.random() < 0.6:
        model.update(position_embedding_type="yarn", rotary_scaling_factor=rng.choice([2.0, 4.0]),
                     yarn_original_max_position_embeddings=8)  # fmt: skip
        if rng.random() < 0.5:
            model.update(mscale=rng.choice([0.7, 1.0]), mscale_all_dim=rng.choice([0.0, 0.5]))
    if rng.random() < 0.6:
        for flag in _NOT_WITH_MTP:
            model.pop(flag, None)
        model.update(mtp_num_layers=rng.choice([1, 2]),
                     mtp_loss_scaling_factor=rng.choice([0.1, 0.3]))  # fmt: skip
    if rng.random() < 0.5:  # weights large enough that rope's kind moves the curve
        model["init_method_std"] = 0.2
