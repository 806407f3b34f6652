"""The values each of megart train's flags with a few spellings takes (argparse's choices),
by TrainConfig field; kept apart from the config, which re-exports them."""

from __future__ import annotations

from megart.models.moe_checks import DROP_POLICIES, SCORE_FUNCTIONS
from megart.models.sink_checks import SOFTMAX_TYPES
from megart.training.config_checks import PIPELINE_SCHEDULES
from megart.training.lr import LR_DECAY_STYLES, WD_INCR_STYLES, WSD_DECAY_STYLES
from megart.training.megatron_flags import ATTENTION_BACKENDS, CKPT_FORMATS, TOKENIZER_TYPES
from megart.training.mla_flags import ROPE_TYPES
from megart.training.model_flags import NORMALIZATIONS, POSITION_EMBEDDING_TYPES
from megart.training.save_modes import NON_PERSISTENT_TYPES

CHOICES = {
    "pipeline_schedule": PIPELINE_SCHEDULES,
    "lr_decay_style": LR_DECAY_STYLES,
    "lr_wsd_decay_style": WSD_DECAY_STYLES,
    "weight_decay_incr_style": WD_INCR_STYLES,
    "normalization": tuple(NORMALIZATIONS),
    "position_embedding_type": tuple(POSITION_EMBEDDING_TYPES),
    "distributed_backend": ("nccl", "shm", "torch"),
    "attention_backend": ATTENTION_BACKENDS,
    "tokenizer_type": TOKENIZER_TYPES,
    "ckpt_format": CKPT_FORMATS,
    "non_persistent_ckpt_type": NON_PERSISTENT_TYPES,
    "empty_unused_memory_level": (0, 1, 2),
    "tiktoken_pattern": ("v1", "v2"),
    "optimizer": ("adam",),
    "transformer_impl": ("local", "transformer_engine"),
    "softmax_type": SOFTMAX_TYPES,
    "cp_comm_type": ("p2p", "all_gather", "a2a", "a2a+p2p"),  # Megatron's; a2a+p2p refused
    "timing_log_level": (0, 1, 2),
    "timing_log_option": ("max", "minmax", "all"),
    "data_order": ("megart", "megatron"),
    "rope_type": ROPE_TYPES,  # yarn is MLA's only (training.mla_flags)
    "moe_router_score_function": SCORE_FUNCTIONS,
    "moe_router_dtype": ("fp32", "fp64"),
    "moe_token_drop_policy": DROP_POLICIES,
    # Megatron's choices: those megart lacks are refused with why (models.moe_checks).
    "moe_router_load_balancing_type": (
        "aux_loss",
        "seq_aux_loss",
        "global_aux_loss",
        "sinkhorn",
        "quantile_balancing",
        "none",
    ),
    # Megatron's choices; flex (DeepEP's) is refused with why (training.moe_kernels).
    "moe_token_dispatcher_type": ("allgather", "alltoall", "flex"),
}
