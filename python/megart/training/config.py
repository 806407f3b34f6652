"""Training configuration, with Megatron-LM's flag names (its checks: config_checks.py)."""

from __future__ import annotations

from dataclasses import dataclass

from megart.models.config import VOCAB_MULTIPLE, GPTConfig
from megart.training.config_checks import check_config
from megart.training.flag_choices import CHOICES as CHOICES  # re-exported: cli.train reads it
from megart.training.lr_flags import LearningRateFlags
from megart.training.megatron_flags import resolve_megatron_flags
from megart.training.mla_flags import MLAFlags
from megart.training.model_flags import gpt_config
from megart.training.yarn_flags import YarnFlags


@dataclass
class TrainConfig(LearningRateFlags, MLAFlags, YarnFlags):
    """Defaults train a small GPT on the built-in corpus in seconds on a CPU."""

    num_layers: int = 4
    hidden_size: int = 128
    num_attention_heads: int = 4
    seq_length: int = 128
    vocab_size: int = 256  # the built-in corpus is bytes
    # Megatron's padding of the vocabulary: to a multiple of this times the tensor-parallel size.
    make_vocab_size_divisible_by: int = VOCAB_MULTIPLE
    # Megatron indexed datasets (PREFIX.bin/.idx): one PREFIX, or a blend "W1 P1 W2 P2 ..." (or
    # "P1 P2 ...", weighted by size); default: the built-in corpus.
    data_path: str | list[str] | None = None
    # Megatron's separate datasets per split, each in --data-path's forms, instead of
    # --data-path cut by --split (megart.training.data.build_split_datasets).
    train_data_path: str | list[str] | None = None
    valid_data_path: str | list[str] | None = None
    test_data_path: str | list[str] | None = None
    micro_batch_size: int = 4
    global_batch_size: int = 16
    # Megatron's START INCREMENT SAMPLES: the global batch grows from START by INCREMENT up to
    # --global-batch-size over SAMPLES consumed samples (megart.training.batch_rampup).
    rampup_batch_size: list[int] | None = None
    train_iters: int = 40
    # Megatron-LM has no default rate (a script gives --lr); the rest are Megatron's defaults.
    lr: float = 3e-3
    min_lr: float = 0.0
    lr_warmup_iters: int = 0
    lr_warmup_fraction: float | None = None  # of the decay iterations; excludes the above
    lr_warmup_init: float = 0.0  # the rate warm-up starts from (Megatron's default)
    lr_decay_iters: int | None = None  # train_iters
    lr_decay_style: str = "linear"
    # WSD's anneal: the decay's last iterations (or samples) and its shape (megart.training.lr)
    lr_wsd_decay_iters: int | None = None
    lr_wsd_decay_style: str = "exponential"
    weight_decay: float = 0.01
    # Megatron's rising weight decay over the run (lr.weight_decay_rate; constant: --weight-decay)
    start_weight_decay: float | None = None
    end_weight_decay: float | None = None
    weight_decay_incr_style: str = "constant"
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    optimizer: str = "adam"  # Megatron's name for its AdamW (decoupled weight decay), megart's
    clip_grad: float = 1.0
    seed: int = 1234
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    # The model's architecture, Megatron's flags and spellings (see gpt_config): the default is
    # GPT-2's; RMSNorm, rope, --swiglu and --disable-bias-linear make a Llama-style model.
    ffn_hidden_size: int | None = None  # 4 h; with --swiglu, Megatron's int(8h/3 / 64) * 64
    init_method_std: float = 0.02
    init_method_xavier_uniform: bool = False  # Glorot's uniform instead (megart.models.init)
    layernorm_epsilon: float = 1e-5
    normalization: str = "LayerNorm"
    apply_layernorm_1p: bool = False  # zero-centred norm weights, applied as 1 + weight
    qk_layernorm: bool = False  # Megatron's: query and key heads normalised before rope
    position_embedding_type: str = "learned_absolute"
    swiglu: bool = False
    squared_relu: bool = False  # relu(x)^2 in the MLP (Megatron's; Nemotron's relu2)
    quick_geglu: bool = False  # gpt-oss's gated MLP, with these two (training.glu_flags)
    glu_linear_offset: float = 0.0
    activation_func_clamp_value: float | None = None
    disable_bias_linear: bool = False
    add_qkv_bias: bool = False  # the q/k/v projection's bias kept under --disable-bias-linear
    untie_embeddings_and_output_weights: bool = False  # the output layer's own weight
    # Grouped-query attention: as in Megatron-LM the group count counts only with the switch
    # (but megart wants it given: Megatron's default of 1 group is multi-query attention).
    group_query_attention: bool = False
    num_query_groups: int | None = None
    # Sliding-window attention, Megatron's spellings: "LEFT,RIGHT" (RIGHT 0: causal) and "N" or
    # a list expression of 0/1 per layer (megart.models.window).
    window_size: str | None = None
    window_attn_skip_freq: str | None = None
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    num_layers_per_virtual_pipeline_stage: int | None = None
    # Megatron's other way to ask for interleaving: model chunks per pipeline rank (the one it
    # takes with uneven stages); 1 is no interleaving.
    num_virtual_stages_per_pipeline_rank: int | None = None
    # Megatron's uneven pipeline stages: the first/last stage's layers, the rest spread evenly
    # over the other stages (megart.models.stages; None: an even split).
    decoder_first_pipeline_num_layers: int | None = None
    decoder_last_pipeline_num_layers: int | None = None
    # None: 1f1b, or interleaved with --num-layers-per-virtual-pipeline-stage (Megatron's rule).
    pipeline_schedule: str | None = None
    sequence_parallel: bool = False
    scatter_gather_tensors_in_pipeline: bool = True
    # Megatron's --use-distributed-optimizer (ZeRO-1): Adam's state sharded over data parallelism.
    use_distributed_optimizer: bool = False
    # Communication: megart's nccl (the default with a GPU) or shm (on CPU), or torch's groups.
    distributed_backend: str | None = None
    bf16: bool = False
    fp16: bool = False  # fp16 compute with dynamic loss scaling (fp32 weights)
    # Under --bf16/--fp16 the residual stream (and so every pipeline message) is 16-bit, as in
    # Megatron-LM; Megatron's --fp32-residual-connection keeps it in fp32 (see GPTConfig).
    fp32_residual_connection: bool = False
    # Under --bf16/--fp16, 16-bit weights with fp32 main weights and gradients in the optimizer
    # (Megatron-LM's way; megart.training.main_weights); without it fp32 weights under autocast.
    half_weights: bool = False
    loss_scale: float | None = None  # a static fp16 loss scale; None: dynamic
    initial_loss_scale: float = 2.0**32
    min_loss_scale: float = 1.0
    loss_scale_window: int = 1000  # overflow-free iterations before the scale doubles
    hysteresis: int = 2  # the scale halves at the N-th overflow since it last grew (Megatron's)
    # megart's fused CUDA kernels (see megart.kernels and GPTConfig); the torch references run
    # where there is no GPU or megart._cuda. Bias + GeLU in the MLP, one kernel: None is
    # Megatron-LM's default, on wherever the MLP has a bias add and GeLU, off (without a word)
    # with another activation or --disable-bias-linear; False is --no-bias-gelu-fusion; True
    # (--bias-gelu-fusion) refused where it cannot apply. The other two: off until faster.
    bias_gelu_fusion: bool | None = None
    # Linear layers add their weight gradients into the fp32 gradient buffers by the product
    # itself (Megatron-LM's default; False is --no-gradient-accumulation-fusion).
    gradient_accumulation_fusion: bool = True
    fused_layer_norm: bool = False  # LayerNorm kernel, the residual add fused into the second
    cross_entropy_loss_fusion: bool = False  # loss and logits gradient in the logits' buffer
    # Activation recomputation (see GPTConfig): --recompute-activations is Megatron's
    # shorthand for --recompute-granularity selective.
    recompute_activations: bool = False
    recompute_granularity: str | None = None
    recompute_method: str = "uniform"
    recompute_num_layers: int = 1
    # What selective recomputation recomputes (models.recompute.MODULES); None, as Megatron's
    # argparse leaves it unset, is Megatron-Core's default, ["core_attn"].
    recompute_modules: list[str] | None = None
    log_interval: int = 1
    # Megatron-LM flags whose effects megart.training.megatron_flags describes and checks.
    max_position_embeddings: int | None = None  # --seq-length (megart's table is that long)
    kv_channels: int | None = None  # each head's width (None: h / heads)
    rotary_base: int = 10000
    rotary_interleaved: bool = False  # rotate adjacent pairs instead of the halves
    use_rope_scaling: bool = False  # Llama 3.x's frequency scaling (GPTConfig.rope_scaling)
    rope_scaling_factor: float = 8.0  # Megatron's default, Llama 3.1's
    # Position interpolation: rope's positions divided by this (Megatron-LM takes an integer;
    # megart any positive number, as Hugging Face's rope type "linear").
    rotary_seq_len_interpolation_factor: float | None = None
    attention_backend: str = "auto"
    softmax_type: str = "vanilla"  # off-by-one, learnable: attention sinks (models.sinks)
    use_flash_attn: bool = False  # Megatron's older switch: --attention-backend flash
    # Megatron-Core's layer implementation; megart's own layers compute the same GPT either way.
    transformer_impl: str = "transformer_engine"
    tokenizer_type: str | None = None
    vocab_file: str | None = None
    merge_file: str | None = None
    tokenizer_model: str | None = None
    mock_data: bool = False
    # megart's own sample order, or Megatron-Core's GPTDataset/BlendedDataset order and
    # sampler (megart.training.megatron_blend); Megatron-LM has no such flag.
    data_order: str = "megart"
    # Megatron-LM's: under --data-order megatron, a pad id equal to the end-of-document id is
    # still masked (megart.training.pad_tokens).
    allow_ambiguous_pad_tokens: bool = False
    # Megatron-LM's switch to validate on the whole validation set: refused (config_checks).
    full_validation: bool = False
    num_workers: int = 2
    mmap_bin_files: bool = True
    create_attention_mask_in_dataloader: bool = True
    # Documents inside a sample, cut at the tokenizer's end-of-document token (see
    # megart.training.documents): no loss for the prediction made from it, positions and
    # attention restarting after it.
    eod_mask_loss: bool = False
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    train_samples: int | None = None
    lr_decay_samples: int | None = None
    lr_wsd_decay_samples: int | None = None
    lr_warmup_samples: int = 0
    # On by default (megart's measured default; Megatron's is off): --no-overlap-grad-reduce
    # reduces every bucket after backward.
    overlap_grad_reduce: bool = True
    overlap_param_gather: bool = False
    # Megatron's gradient bucket size in elements, or its number of buckets (grad_sync's
    # megatron_bucket_size); neither: megart's 4 MiB buckets.
    ddp_bucket_size: int | None = None
    ddp_num_buckets: int | None = None
    decoupled_lr: float | None = None  # the embedding's and output layer's own peak rate
    decoupled_min_lr: float | None = None  # and floor (default: --min-lr)
    grad_reduce_in_bf16: bool = False  # with --bf16: buckets travel in bf16 (grad_sync)
    # megart's gradients are fp32 and reduced in fp32 always; the flag is Megatron's record of it.
    accumulate_allreduce_grads_in_fp32: bool = False
    log_throughput: bool = False
    ckpt_format: str = "megart"
    calculate_per_token_loss: bool = False
    context_parallel_size: int = 1
    # How K and V travel between context-parallel ranks: around a ring ("p2p", Megatron's
    # default, megart.models.ring_attention, its blocks by flash kernels where they apply),
    # all-gathered ("all_gather") or exchanged for heads ("a2a"); Megatron's hierarchical
    # "a2a+p2p" is refused.
    cp_comm_type: str = "p2p"
    expert_model_parallel_size: int = 1
    # Mixture of experts, Megatron's flags (GPTConfig's fields of the same names, models.moe);
    # --moe-layer-freq is "N" or a list expression of 0/1 per layer, as --window-attn-skip-freq.
    num_experts: int | None = None
    moe_ffn_hidden_size: int | None = None
    moe_layer_freq: str | None = None
    moe_router_topk: int = 2
    moe_router_pre_softmax: bool = False
    moe_router_score_function: str = "softmax"
    moe_router_topk_scaling_factor: float | None = None
    moe_router_dtype: str | None = None
    moe_router_load_balancing_type: str = "aux_loss"
    moe_aux_loss_coeff: float = 0.0
    moe_z_loss_coeff: float | None = None
    moe_router_enable_expert_bias: bool = False
    moe_router_bias_update_rate: float = 1e-3
    moe_router_num_groups: int | None = None
    moe_router_group_topk: int | None = None
    moe_shared_expert_intermediate_size: int | None = None
    moe_shared_expert_gate: bool = False
    # Kernel and dispatch choices of Megatron-Core's MoE layer that leave its math unchanged:
    # megart's layer computes what each computes (training.moe_kernels says what it does).
    moe_token_dispatcher_type: str = "allgather"
    moe_grouped_gemm: bool = False
    moe_permute_fusion: bool = False
    moe_router_fusion: bool = False
    # Token dropping (a negative factor is none, as Megatron-LM reads it).
    moe_expert_capacity_factor: float | None = None
    moe_token_drop_policy: str = "probs"
    moe_pad_expert_input_to_capacity: bool = False
    # Megatron's: start from --load's dense checkpoint, its MLPs copied (or sliced, by the
    # granularity) into the experts, saved to --save as iteration 1 (megart.training.upcycling).
    moe_use_upcycling: bool = False
    moe_upcycling_granularity: int = 1
    # The router's noise (GPTConfig's fields, models.router_noise) and each layer's auxiliary
    # losses in the log (training.moe_metrics).
    moe_input_jitter_eps: float | None = None
    moe_router_force_load_balancing: bool = False
    moe_per_layer_logging: bool = False
    # Multi-token prediction (GPTConfig's fields, models.mtp; training.mtp_checks).
    mtp_num_layers: int | None = None
    mtp_loss_scaling_factor: float = 0.1
    use_mcore_models: bool = False  # Megatron's deprecated switch: its GPTModel is megart's
    rotary_percent: float = 1.0  # the part of each head rope turns (GPTConfig.rotary_percent)
    data_cache_path: str | None = None  # --data-order megatron's indices, built once
    tiktoken_pattern: str | None = None  # TikTokenizer's (not a tokenizer megart takes)
    # What Megatron-LM does around each iteration besides training (megart.training.housekeeping).
    manual_gc: bool = False
    manual_gc_interval: int = 0
    manual_gc_eval: bool = True
    empty_unused_memory_level: int = 0
    profile: bool = False
    profile_step_start: int = 10
    profile_step_end: int = 12
    use_pytorch_profiler: bool = False
    profile_ranks: list[int] | None = None  # None: every rank
    pytorch_profiler_collect_shapes: bool = False
    pytorch_profiler_collect_callstack: bool = False
    # Validation, as Megatron-LM: --split weights carve the corpus into consecutive train,
    # validation and test ranges; every --eval-interval iterations and after the last, the
    # loss over --eval-iters global batches of the validation range (0: no evaluation), and
    # after the last, as many of the test range (Megatron's "for test data" line).
    # Megatron's defaults are 1000 and 100, sized for long runs; these suit the default run.
    eval_interval: int = 20
    eval_iters: int = 4
    # Megatron's: each evaluation batch's samples and microbatch (None: the training ones).
    eval_global_batch_size: int | None = None
    eval_micro_batch_size: int | None = None
    split: str | None = None  # None: Megatron's legacy default, DEFAULT_SPLIT
    log_jsonl: str | None = None
    tensorboard_dir: str | None = None  # TensorBoard scalars (needs the tensorboard package)
    log_memory_to_tensorboard: bool = False  # Megatron's mem-* scalars there too (CUDA only)
    tensorboard_log_interval: int = 1  # iterations between TensorBoard's scalars (Megatron's)
    log_validation_ppl_to_tensorboard: bool = False  # megart writes the perplexities always
    # Megatron's optional figures of each iteration (megart.training.iteration_stats).
    log_params_norm: bool = False
    log_num_zeros_in_grad: bool = False
    log_world_size_to_tensorboard: bool = False
    # Megatron's per-phase timers (megart.training.timers): 0 none, 1 the iteration's phases,
    # 2 also the batch generator; reported every --log-interval iterations.
    timing_log_level: int = 0
    timing_log_option: str = "minmax"
    log_timers_to_tensorboard: bool = False
    save: str | None = None  # directory to write checkpoints to
    save_interval: int | None = None  # iterations between checkpoints (and one at the end)
    save_retain_interval: int | None = (
        None  # Megatron's: keep these and the latest, delete the rest
    )
    # Megatron's non-persistent checkpoints and background saves (megart.training.save_modes).
    non_persistent_save_interval: int | None = None
    non_persistent_ckpt_type: str | None = None
    non_persistent_global_ckpt_dir: str | None = None  # None: <save>/non_persistent
    async_save: bool = False
    # Megatron's: checkpoints without the optimizer state (and fp16 loss scale), or without
    # the random streams (smaller; resuming from one then needs --no-load-optim/--no-load-rng).
    no_save_optim: bool = False
    no_save_rng: bool = False
    load: str | None = None  # directory to resume from (its latest checkpoint)
    # Megatron's: skip --load's optimizer state (and fp16 loss scale), or its random streams;
    # --finetune loads the model weights only and starts at iteration 0.
    no_load_optim: bool = False
    no_load_rng: bool = False
    finetune: bool = False
    # Megatron's --override-opt_param-scheduler: a Megatron-LM checkpoint's saved learning-rate
    # schedule (lr, warm-up, decay iterations and style, weight decay) may differ from this
    # run's flags, which the schedule follows (megart's own format always takes the flags).
    override_opt_param_scheduler: bool = False
    # Megatron's --use-checkpoint-opt_param-scheduler: the other way, the saved schedule in
    # place of the flags' (megart.training.checkpoint_scheduler, which sets the flags to it).
    use_checkpoint_opt_param_scheduler: bool = False
    # Megatron's: where --load holds no checkpoint yet (a restartable fine-tuning job's first
    # run), this checkpoint's weights, from iteration 0, as --finetune.
    pretrained_checkpoint: str | None = None
    # Megatron's: load --load's checkpoint of iteration N instead of its latest; and stop when
    # --load holds no checkpoint, instead of starting from scratch.
    ckpt_step: int | None = None
    exit_on_missing_checkpoint: bool = False
    # Megatron's early exits (megart.training.stopping), each saving first when --save is given.
    exit_interval: int | None = None  # stop after every N-th iteration
    exit_duration_in_mins: float | None = None  # stop once the run has trained this long
    exit_signal_handler: bool = False  # stop after the iteration in which SIGTERM arrived
    # A gradient norm or loss that is not finite stops the run (TrainingError).
    check_for_nan_in_loss_and_grad: bool = True
    # Megatron's: every wait on another rank gives up after this long, naming the rank waited on.
    distributed_timeout_minutes: float = 10

    def __post_init__(self) -> None:
        resolve_megatron_flags(self)  # the tokenizer's vocabulary, --train-samples' iterations

    @property
    def tp(self) -> int:
        return self.tensor_model_parallel_size

    @property
    def pp(self) -> int:
        return self.pipeline_model_parallel_size

    @property
    def schedule(self) -> str:
        """The pipeline schedule this run uses."""
        if self.pipeline_schedule is not None:
            return self.pipeline_schedule
        chunks = self.num_virtual_stages_per_pipeline_rank or 1
        interleaved = self.num_layers_per_virtual_pipeline_stage is not None or chunks > 1
        return "interleaved" if interleaved else "1f1b"

    @property
    def chunks(self) -> int:
        """Model chunks per pipeline rank (v): zb-v's V takes two, each half a stage's layers."""
        if self.schedule == "zb-v":
            return 2
        if self.num_virtual_stages_per_pipeline_rank is not None:
            return self.num_virtual_stages_per_pipeline_rank
        per = self.num_layers_per_virtual_pipeline_stage
        return 1 if per is None else self.num_layers // (self.pp * per)

    @property
    def stages(self) -> dict[str, int | None]:
        """chunk_layers' and pipeline_chunks' ``first``/``last``: the uneven stages' layers."""
        return {
            "first": self.decoder_first_pipeline_num_layers,
            "last": self.decoder_last_pipeline_num_layers,
        }

    def gpt_config(self) -> GPTConfig:
        """The model these flags describe (megart.training.model_flags.gpt_config)."""
        return gpt_config(self)

    def _ffn_hidden_size(self) -> int | None:
        """--ffn-hidden-size; with --swiglu and none given, Megatron's int(4h * 2/3 / 64) * 64
        (two of SwiGLU's three matrices in the parameters of GeLU's two, rounded down to a
        multiple of 64); otherwise None (GPTConfig's 4 h, as checkpoints have recorded it)."""
        if self.ffn_hidden_size is None and self.swiglu:
            return self.hidden_size // 24 * 64  # the same integer, without float rounding
        return self.ffn_hidden_size

    @property
    def eval_batch_sizes(self) -> tuple[int, int]:
        """(samples, microbatch) of an evaluation batch: --eval-global-batch-size and
        --eval-micro-batch-size, by default --global-batch-size and --micro-batch-size."""
        size, micro = self.eval_global_batch_size, self.eval_micro_batch_size
        return (self.global_batch_size if size is None else size,
                self.micro_batch_size if micro is None else micro)  # fmt: skip

    def microbatches(self, dp: int, batch: int | None = None) -> int:
        """Microbatches per data-parallel rank of a global batch of ``batch`` samples (None:
        --global-batch-size; under --rampup-batch-size an iteration's may be smaller)."""
        return (batch or self.global_batch_size) // (self.micro_batch_size * dp)

    def check(self, world_size: int) -> int:
        """Refuses layouts, batch shapes and flag combinations that cannot run, naming the
        numbers and flags and what would fit; returns the data-parallel size."""
        return check_config(self, world_size)
