"""What megart plan does with each of megart train's flags, so that a training command line
plans unchanged (megart train FLAGS -> megart plan --gpu G --num-gpus N FLAGS).

Every TrainConfig field is in exactly one of these (tests/test_plan_train_flags.py):
- LAYOUT: given, fixed; left out, searched (megart.cli.plan).
- MODELLED: the estimate reads it (the model's shape, the batch, the precision, what the
  runtime holds and sends), or megart train's checks on it limit the layouts.
- NO_EFFECT: changes neither an iteration's time nor what a GPU holds in it (the learning rate
  and its schedule, data and tokenizer files, checkpoints, logging, evaluation, seeds...), or
  is accepted only at values that change nothing (--max-position-embeddings).
- UNMODELLED: changes time or memory in a way the planner does not model; refused by name
  unless left at megart train's default (or another value the plan predicts alike), so that no
  prediction silently describes another run.
"""

from __future__ import annotations

from typing import Any

from megart.errors import ConfigError
from megart.plan.documents import refuse_windowed_documents
from megart.plan.layout import ZERO_BUBBLE
from megart.plan.window_memory import masking_window
from megart.training.config import TrainConfig

LAYOUT = (
    "micro_batch_size",
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "num_layers_per_virtual_pipeline_stage",
    "num_virtual_stages_per_pipeline_rank",
    "decoder_first_pipeline_num_layers",
    "decoder_last_pipeline_num_layers",
    "pipeline_schedule",
    "sequence_parallel",
    "recompute_granularity",
    "recompute_activations",  # Megatron's switch for --recompute-granularity selective
    "use_distributed_optimizer",
    "context_parallel_size",
    # Searched for MoE models beside any t and cp (plan.candidates); a dense model's above 1 is
    # megart train's refusal.
    "expert_model_parallel_size",
)

# The tokenizer sets the vocabulary when --vocab-size is left out (TrainConfig resolves it).
TOKENIZER = ("tokenizer_type", "vocab_file", "merge_file", "tokenizer_model", "tiktoken_pattern")

MODELLED = (
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "kv_channels",  # the heads' width: q = heads x d in attention (megart's runtime only)
    "seq_length",
    "vocab_size",
    "make_vocab_size_divisible_by",  # the padded vocabulary: embedding, logits
    "global_batch_size",
    "hidden_dropout",  # its masks are held for backward
    "ffn_hidden_size",
    "normalization",
    "qk_layernorm",
    "position_embedding_type",
    "rotary_percent",
    "swiglu",
    "squared_relu",
    "disable_bias_linear",
    "add_qkv_bias",  # the q/k/v projection's bias: parameters (plan.parameters)
    "untie_embeddings_and_output_weights",
    "group_query_attention",
    "num_query_groups",
    "bf16",
    "fp16",
    "fp32_residual_connection",
    "half_weights",
    "cp_comm_type",
    # Windowed layers' attention as megart runs it (query tiles; their time, and their cached
    # bias and extra outputs in memory, plan.window_memory; under the ring the pieces of its
    # blocks inside the window, plan.ring_window_cost).
    "window_size",
    "window_attn_skip_freq",
    # The data-parallel reduction (plan.data_parallel, plan.parameters): exposed or overlapped,
    # its buckets, 2 bytes an element and the buckets' bf16 copies. --overlap-param-gather
    # changes no time in megart's runtime (each chunk's forward waits for all its buckets) but
    # needs the distributed optimizer (megart train's check limits the layouts).
    "overlap_grad_reduce",
    "overlap_param_gather",
    "ddp_bucket_size",
    "ddp_num_buckets",
    "grad_reduce_in_bf16",
    # Which layers full recomputation replays and keeps (plan.memory, estimate._stage_work).
    "recompute_method",
    "recompute_num_layers",
    # What selective recomputation drops and replays (activations.layer_bytes, timing.layer_work,
    # the recomputed MLPs' FLOPs); megart train refuses it without selective recomputation.
    "recompute_modules",
    "scatter_gather_tensors_in_pipeline",  # pipeline messages of b s h / t, or b s h without
    # The loss's saves (the logits instead of an fp32 softmax) and its element-wise passes
    # (timing.logits_work: one read forward, a read and a write backward, of 16-bit logits).
    "cross_entropy_loss_fusion",
    # The ramp's batches must split over a layout's data-parallel ranks (megart train's check);
    # the plan is the full batch's iteration.
    "rampup_batch_size",
    # Documents inside a sample (plan.documents): under the documents' mask each layer's
    # attention scores every s x s entry and keeps that mask, as a bias or as booleans, once
    # per (microbatch, chunk); reset positions give each sample its own rope tables (or index
    # the learned table), and --eod-mask-loss's loss keeps its mask. With context parallelism
    # megart train refuses the mask (its check limits the layouts).
    "reset_attention_mask",
    "reset_position_ids",
    "eod_mask_loss",
    # Mixture of experts (plan.moe_memory, plan.moe_time; parameters, FLOPs): the experts'
    # weights and state, the router's and experts' saves, their products and, split over
    # tensor-parallel ranks, the dispatcher's gathers; spread over expert-parallel ranks
    # (a layout flag), their all-to-alls; under context parallelism over the rank's s/cp
    # tokens.
    "num_experts",
    "moe_ffn_hidden_size",
    "moe_layer_freq",
    "moe_router_topk",
    "moe_router_pre_softmax",
    "moe_router_score_function",
    "moe_router_dtype",
    "moe_aux_loss_coeff",
    "moe_z_loss_coeff",
    # The shared experts: a dense MLP of this width in each MoE layer, tensor-parallel as the
    # dense one and replicated under expert parallelism (weights in the dense buckets, saves,
    # products, collectives).
    "moe_shared_expert_intermediate_size",
    "moe_shared_expert_gate",  # its [1, h] weight, saves, product (plan.moe_memory, moe_time)
    # The router's options: their saves (plan.moe_memory: the groups' mask, seq_aux_loss's
    # per-sequence counts, global_aux_loss's running mean); their work is over E beside the
    # layer's h-wide work, and the bias's update one all-reduce of layers x E a step: no time.
    "moe_router_enable_expert_bias",
    "moe_router_num_groups",
    "moe_router_group_topk",
    "moe_router_load_balancing_type",
    # Grouped experts cast their weights' stack for each product and keep no 16-bit copy
    # (models.moe_grouped): fewer autocast copies; the same saves, products and time.
    "moe_grouped_gemm",
    # Multi-latent attention (plan.mla_memory, plan.parameters, timing.layer_work): its
    # projections and latent norms split as models.mla splits them, its saves, products and,
    # over tensor-parallel ranks, its latents' gathers.
    "multi_latent_attention",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_head_dim",
    "qk_pos_emb_head_dim",
    "v_head_dim",
    "rope_type",  # plain rope's name, which MLA's checks ask for (the only rope megart turns)
    # Multi-token prediction's depths on the last stage (plan.mtp_memory, plan.parameters,
    # estimate): their weights, the last stage's copy of the embedding, their saves, layers,
    # projections and logits.
    "mtp_num_layers",
    # Attention sinks (models.sinks): learnable's logits are parameters (plan.parameters); the
    # sink enters the same kernels (torch's flash kernels on a GPU, which return the
    # log-sum-exp; the ring's merge) with one more element-wise pass over the attention's
    # output, which the plan leaves out. Where it takes other kernels (a window's full s x s
    # bias instead of query tiles, all_gather's masked call instead of its blockwise one)
    # refuse_sink_kernels refuses it.
    "softmax_type",
    *TOKENIZER,
)

# field -> (the values the plan predicts alike, why another one is not modelled)
UNMODELLED: dict[str, tuple[tuple[Any, ...], str]] = {
    "attention_backend": (
        ("auto", "flash", "fused"),
        "the unfused attention's s x s scores (torch's fused kernels are planned)",
    ),
    "bias_gelu_fusion": ((None, True), "the element-wise work and memory of an unfused MLP"),
    # gpt-oss's MLP (training.glu_flags): the plan counts two first products for --swiglu only.
    "quick_geglu": ((False,), "quick GeGLU's second first product and its element-wise work"),
    "glu_linear_offset": ((0.0,), "the offset's element-wise work"),
    "activation_func_clamp_value": ((None,), "the clamp's element-wise work and masks"),
    "gradient_accumulation_fusion": (
        (True,),
        "weight gradients made apart and then added to the main gradients",
    ),
    "fused_layer_norm": ((False,), "the fused LayerNorm's element-wise work and memory"),
    # Per-iteration work megart train adds for its logs, and the allocator emptied each step.
    "log_params_norm": ((False,), "a pass over the weights and an all-reduce each iteration"),
    "log_num_zeros_in_grad": ((False,), "a pass over the gradients each iteration"),
    "timing_log_level": ((0,), "a device synchronisation at each timed phase"),
    "empty_unused_memory_level": ((0,), "the allocator's cache emptied and refilled"),
    "moe_expert_capacity_factor": (
        (None,),
        "token dropping: the capacity masks and the experts' fewer (or padded) tokens",
    ),
    "moe_token_drop_policy": (("probs",), "token dropping's choice of the tokens kept"),
    "moe_pad_expert_input_to_capacity": ((False,), "the experts' inputs padded to capacity"),
    # The jitter's noise (h per token, kept for the gradient) and the jittered input the
    # router's product keeps in place of the layer's input: two h-wide saves per MoE layer.
    "moe_input_jitter_eps": ((None,), "the router's jittered input and its noise, saved"),
}

# Modelled for megart's runtime only: --runtime megatron (Megatron-LM's conventions, for the
# published tables) refuses them rather than predict as if they were left out.
MEGART_RUNTIME_ONLY = (
    "window_size",
    "window_attn_skip_freq",
    "overlap_grad_reduce",
    "ddp_bucket_size",
    "ddp_num_buckets",
    "grad_reduce_in_bf16",
    "cross_entropy_loss_fusion",
    "reset_attention_mask",
    "num_experts",  # Korthikanti et al.'s count has no experts
    "multi_latent_attention",  # nor latents, nor prediction depths
    "mtp_num_layers",
    "softmax_type",  # nor sinks
)

# Accepted and change nothing in the prediction: the optimizer's hyperparameters and schedule
# (megart's Adam either way), initialisation, data and its order, loss scaling, rope's
# frequencies (the same work), checkpoints (written between iterations, copied to the host under
# --async-save), logging, profiling, evaluation (the plan is a training iteration's), exits.
NO_EFFECT = (
    # the optimizer and its schedule
    "train_iters", "train_samples", "lr", "min_lr", "lr_warmup_iters",
    "lr_warmup_fraction", "lr_warmup_init", "lr_warmup_samples", "lr_decay_iters",
    "lr_decay_samples", "lr_decay_style", "lr_wsd_decay_iters", "lr_wsd_decay_samples",
    "lr_wsd_decay_style", "decoupled_lr", "decoupled_min_lr", "weight_decay",
    "adam_beta1", "adam_beta2", "adam_eps", "optimizer", "clip_grad", "start_weight_decay",
    "end_weight_decay", "weight_decay_incr_style",
    # initial values and numerics that do not change the work
    "seed", "init_method_std", "init_method_xavier_uniform", "layernorm_epsilon",
    "apply_layernorm_1p", "rotary_base", "rotary_interleaved", "use_rope_scaling",
    "rope_scaling_factor", "rotary_seq_len_interpolation_factor", "loss_scale",
    # YaRN's settings: rope's angles and cos/sin times a number (--position-embedding-type
    # yarn plans as rope: the same tables, the same rotation, the same saves)
    "rotary_scaling_factor", "yarn_original_max_position_embeddings", "yarn_beta_fast",
    "yarn_beta_slow", "mscale", "mscale_all_dim", "yarn_correction_range_round_to_int",
    "initial_loss_scale", "min_loss_scale", "loss_scale_window", "hysteresis",
    "calculate_per_token_loss", "check_for_nan_in_loss_and_grad",
    # Where they change nothing: a learned position table of --seq-length rows (megart
    # train's only); megart's gradients are fp32 always
    "max_position_embeddings", "accumulate_allreduce_grads_in_fp32",
    # inside torch's attention kernels on a GPU (no mask held); --use-flash-attn sets
    # --attention-backend flash, and the implementations name the same attention
    "attention_dropout", "use_flash_attn", "transformer_impl", "use_mcore_models",
    # the routing weights times a number (nothing saved)
    "moe_router_topk_scaling_factor",
    # MoE dispatch and kernel choices: megart's layer runs the same way under each
    # (training.moe_kernels).
    "moe_token_dispatcher_type", "moe_permute_fusion", "moe_router_fusion",
    "moe_router_bias_update_rate",  # the expert bias's step, a number (no work)
    # Random logits in place of the router's (E per token, beside the layer's h-wide work and
    # saves): routing balanced by chance, as the plan's experts' shares already are (balanced).
    "moe_router_force_load_balancing",
    "moe_per_layer_logging",  # logging: each layer's losses in one all-reduce already made
    "mtp_loss_scaling_factor",  # a number on the depths' losses
    "distributed_backend",
    # data
    "data_path", "train_data_path", "valid_data_path", "test_data_path", "split", "mock_data",
    "data_order", "data_cache_path", "allow_ambiguous_pad_tokens", "num_workers",
    "mmap_bin_files", "create_attention_mask_in_dataloader",
    # evaluation, checkpoints, exits
    "moe_use_upcycling", "moe_upcycling_granularity",  # where the weights start from
    "eval_interval", "eval_iters", "eval_global_batch_size",
    "eval_micro_batch_size", "full_validation", "ckpt_format", "save", "save_interval",
    "save_retain_interval", "non_persistent_save_interval", "non_persistent_ckpt_type",
    "non_persistent_global_ckpt_dir", "async_save", "no_save_optim", "no_save_rng", "load",
    "no_load_optim", "no_load_rng", "finetune", "override_opt_param_scheduler",
    "use_checkpoint_opt_param_scheduler",
    "pretrained_checkpoint", "ckpt_step",
    "exit_on_missing_checkpoint", "exit_interval", "exit_duration_in_mins",
    "exit_signal_handler", "distributed_timeout_minutes",
    # host-side housekeeping: garbage collection, the allocator's cache (peak bytes unchanged)
    "manual_gc", "manual_gc_interval", "manual_gc_eval",
    # logging and profiling
    "log_interval", "log_throughput", "log_jsonl", "tensorboard_dir", "tensorboard_log_interval",
    "log_memory_to_tensorboard", "log_validation_ppl_to_tensorboard",
    "log_world_size_to_tensorboard", "log_timers_to_tensorboard",
    "timing_log_option", "profile", "profile_step_start", "profile_step_end",
    "use_pytorch_profiler", "profile_ranks", "pytorch_profiler_collect_shapes",
    "pytorch_profiler_collect_callstack",
)  # fmt: skip


def flag(name: str, value: Any) -> str:
    """How ``value`` of field ``name`` is spelt on megart train's command line."""
    spelt = "--" + name.replace("_", "-")
    if value is True:
        return spelt
    if value is False:
        return "--no-" + spelt[2:]
    if isinstance(value, (list, tuple)):
        return f"{spelt} {' '.join(map(str, value))}"
    return f"{spelt} {value}"


def refuse_sink_kernels(c: TrainConfig) -> None:
    """Refuses attention sinks where megart's attention then runs other kernels than the
    planned ones (see MODELLED's softmax_type)."""
    if c.softmax_type == "vanilla":
        return
    cfg = c.gpt_config()
    why = ""
    if any(masking_window(cfg, i) is not None for i in range(cfg.num_layers)):
        why = f"--window-size {cfg.window_size[0]},{cfg.window_size[1]}: the window's s x s bias"
    elif c.context_parallel_size > 1 and c.cp_comm_type == "all_gather":
        why = "--cp-comm-type all_gather: one masked call over the gathered keys"
    if why:
        raise ConfigError(
            f"megart plan does not model --softmax-type {c.softmax_type} with {why} (a sink "
            "takes that path instead of the planned kernels); leave one of them out to plan it"
        )


def refuse_unmodelled(config: TrainConfig, runtime: str = "megart") -> None:
    """Refuses, naming each, the flags of ``config`` whose effect the planner does not model
    (for ``runtime``), and the combinations it does not model."""
    refuse_windowed_documents(config)
    refuse_sink_kernels(config)
    refused = []
    for name, (alike, what) in UNMODELLED.items():
        value = getattr(config, name)
        if value not in alike:
            refused.append(f"{flag(name, value)} ({what})")
    if runtime != "megart":
        # Megatron-LM's activations are Korthikanti et al.'s count, whose heads are h / heads.
        d, h, heads = config.kv_channels, config.hidden_size, config.num_attention_heads
        if d is not None and d >= 1 and d * heads != h:  # (below 1: megart train's refusal)
            refused.append(f"--kv-channels {d} (heads other than --hidden-size / heads, with "
                           f"--runtime {runtime})")  # fmt: skip
        modules = config.recompute_modules
        if modules is not None and set(modules) != {"core_attn"}:  # Korthikanti et al.'s
            refused.append(f"{flag('recompute_modules', modules)} (Megatron-LM's selective "
                           f"count is the attention core's, with --runtime {runtime})")  # fmt: skip
        default = TrainConfig()
        for name in MEGART_RUNTIME_ONLY:
            value = getattr(config, name)
            if value != getattr(default, name):
                refused.append(f"{flag(name, value)} (with --runtime {runtime})")
    refused += _moe_unmodelled(config) + _latent_unmodelled(config)
    if refused:
        raise ConfigError(
            "megart plan does not model "
            + "; ".join(refused)
            + ": leave "
            + ("it" if len(refused) == 1 else "them")
            + " out to plan megart train's default"
        )


def _moe_unmodelled(config: TrainConfig) -> list[str]:
    """What the planner does not model with --num-experts: zero-bubble schedules (the experts'
    deferred weight gradients are uncounted; searched layouts leave them out,
    plan.candidates) and --recompute-modules layernorm (megart train's MoE layers cannot run it
    yet); its moe and shared_experts are modelled (plan.moe_memory, timing.layer_work). Tensor
    parallelism is modelled (with
    sequence parallelism, which megart train requires for experts: plan.candidates refuses a
    given t > 1 without it in its words), and expert parallelism at t = cp = 1, with the
    distributed optimizer too (each bucket set sharded over its own group; megart train's
    checks refuse what it cannot run in its words)."""
    if not config.num_experts:
        return []
    out = []
    if config.pipeline_schedule in ZERO_BUBBLE:
        out.append(f"--pipeline-schedule {config.pipeline_schedule} with --num-experts")
    modules = config.recompute_modules or ()
    if "layernorm" in modules:  # not built for MoE layers yet
        out.append(f"{flag('recompute_modules', modules)} with --num-experts")
    return out


def _latent_unmodelled(config: TrainConfig) -> list[str]:
    """What the planner does not model with --mtp-num-layers: the document flags (their
    shifted masks and positions are unmeasured). Zero-bubble schedules' deferred weight
    gradients are counted with MLA (plan.mla_memory.mla_weight_grad_elements) and the depths
    (plan.mtp_memory.mtp_weight_grad_bytes), --recompute-modules layernorm with both as with
    megart's attention (tests/test_plan_mla_layernorm.py), and a depth's MoE layer (where the
    last decoder layer is one) as the decoder's (plan.mtp_memory, plan.mtp_time)."""
    out = []
    if config.mtp_num_layers:
        for field in ("reset_attention_mask", "reset_position_ids", "eod_mask_loss"):
            if getattr(config, field):
                out.append(f"{flag(field, True)} with --mtp-num-layers")
    return out
