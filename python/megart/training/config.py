"""Training configuration, with Megatron-LM's flag names, and the checks made before any work."""

from __future__ import annotations

from dataclasses import dataclass

from megart.errors import ConfigError
from megart.models.config import MEGATRON_NORMS, MEGATRON_POSITIONS, GPTConfig
from megart.parallel.layout import divisors
from megart.training.batch_rampup import check_rampup
from megart.training.lr import LR_DECAY_STYLES, check_decay_style, learning_rate
from megart.training.megatron_flags import (
    ATTENTION_BACKENDS,
    CKPT_FORMATS,
    TOKENIZER_TYPES,
    check_megatron_flags,
    resolve_megatron_flags,
)

DEFAULT_WARMUP_ITERS = 4  # warm-up of the default run, when neither warm-up flag is given
# Megatron's spellings of --normalization and --position-embedding-type, to GPTConfig's names.
NORMALIZATIONS = {flag: name for name, flag in MEGATRON_NORMS.items()}
POSITION_EMBEDDING_TYPES = {flag: name for name, flag in MEGATRON_POSITIONS.items()}
# The flags whose values are one of a few spellings (argparse's choices).
# The pipeline schedules `megart train` runs (megart.schedule builds more, gpipe among them).
PIPELINE_SCHEDULES = ("1f1b", "interleaved", "zb-h1", "zb-v")

CHOICES = {
    "pipeline_schedule": PIPELINE_SCHEDULES,
    "lr_decay_style": LR_DECAY_STYLES,
    "normalization": tuple(NORMALIZATIONS),
    "position_embedding_type": tuple(POSITION_EMBEDDING_TYPES),
    "distributed_backend": ("nccl", "shm", "torch"),
    "attention_backend": ATTENTION_BACKENDS,
    "tokenizer_type": TOKENIZER_TYPES,
    "ckpt_format": CKPT_FORMATS,
}


@dataclass
class TrainConfig:
    """Defaults train a small GPT on the built-in corpus in seconds on a CPU."""

    num_layers: int = 4
    hidden_size: int = 128
    num_attention_heads: int = 4
    seq_length: int = 128
    vocab_size: int = 256  # the built-in corpus is bytes
    # Megatron indexed datasets (PREFIX.bin/.idx): one PREFIX, or a blend "W1 P1 W2 P2 ..." (or
    # "P1 P2 ...", weighted by size); default: the built-in corpus.
    data_path: str | list[str] | None = None
    micro_batch_size: int = 4
    global_batch_size: int = 16
    # Megatron's START INCREMENT SAMPLES: the global batch grows from START by INCREMENT up to
    # --global-batch-size over SAMPLES consumed samples (megart.training.batch_rampup).
    rampup_batch_size: list[int] | None = None
    train_iters: int = 40
    lr: float = 3e-3
    min_lr: float = 3e-4
    # None: DEFAULT_WARMUP_ITERS, or 0 with --lr-warmup-fraction (Megatron's default is 0).
    lr_warmup_iters: int | None = None
    lr_warmup_fraction: float | None = None  # of the decay iterations; excludes the above
    lr_decay_iters: int | None = None  # train_iters
    # Megatron's default is linear; megart's default run (and its recorded figures) is cosine.
    lr_decay_style: str = "cosine"
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    seed: int = 1234
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    # The model's architecture, Megatron's flags and spellings (see gpt_config): the default is
    # GPT-2's; RMSNorm, rope, --swiglu and --disable-bias-linear make a Llama-style model.
    ffn_hidden_size: int | None = None  # 4 h; with --swiglu, Megatron's int(8h/3 / 64) * 64
    init_method_std: float = 0.02
    layernorm_epsilon: float = 1e-5
    normalization: str = "LayerNorm"
    position_embedding_type: str = "learned_absolute"
    swiglu: bool = False
    disable_bias_linear: bool = False
    untie_embeddings_and_output_weights: bool = False  # the output layer's own weight
    # Grouped-query attention: as in Megatron-LM the group count counts only with the switch
    # (but megart wants it given: Megatron's default of 1 group is multi-query attention).
    group_query_attention: bool = False
    num_query_groups: int | None = None
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    num_layers_per_virtual_pipeline_stage: int | None = None
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
    loss_scale: float | None = None  # a static fp16 loss scale; None: dynamic
    initial_loss_scale: float = 2.0**32
    min_loss_scale: float = 1.0
    loss_scale_window: int = 1000  # overflow-free iterations before the scale doubles
    # megart's fused CUDA kernels (see megart.kernels and GPTConfig); the torch references run
    # where there is no GPU or megart._cuda. Off until measured faster than torch on a GPU.
    bias_gelu_fusion: bool = False  # bias add + GeLU in the MLP, one kernel
    fused_layer_norm: bool = False  # LayerNorm kernel, the residual add fused into the second
    cross_entropy_loss_fusion: bool = False  # loss and logits gradient in the logits' buffer
    # Activation recomputation (see GPTConfig): --recompute-activations is Megatron's
    # shorthand for --recompute-granularity selective.
    recompute_activations: bool = False
    recompute_granularity: str | None = None
    recompute_method: str = "uniform"
    recompute_num_layers: int = 1
    log_interval: int = 1
    # Megatron-LM flags whose effects megart.training.megatron_flags describes and checks.
    max_position_embeddings: int | None = None  # --seq-length (megart's table is that long)
    kv_channels: int | None = None  # head size: h / heads (megart's only)
    rotary_base: int = 10000
    rotary_interleaved: bool = False  # rotate adjacent pairs instead of the halves
    attention_backend: str = "auto"
    tokenizer_type: str | None = None
    vocab_file: str | None = None
    merge_file: str | None = None
    tokenizer_model: str | None = None
    mock_data: bool = False
    num_workers: int = 2
    mmap_bin_files: bool = True
    create_attention_mask_in_dataloader: bool = True
    train_samples: int | None = None
    lr_decay_samples: int | None = None
    lr_warmup_samples: int = 0
    # On by default (megart's measured default; Megatron's is off): --no-overlap-grad-reduce
    # reduces every bucket after backward.
    overlap_grad_reduce: bool = True
    overlap_param_gather: bool = False
    log_throughput: bool = False
    ckpt_format: str = "megart"
    calculate_per_token_loss: bool = False
    context_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    # Validation, as Megatron-LM: --split weights carve the corpus into consecutive train,
    # validation and test ranges; every --eval-interval iterations and after the last, the
    # loss over --eval-iters global batches of the validation range (0: no evaluation), and
    # after the last, as many of the test range (Megatron's "for test data" line).
    # Megatron's defaults are 1000 and 100, sized for long runs; these suit the default run.
    eval_interval: int = 20
    eval_iters: int = 4
    split: str = "969,30,1"
    log_jsonl: str | None = None
    tensorboard_dir: str | None = None  # TensorBoard scalars (needs the tensorboard package)
    save: str | None = None  # directory to write checkpoints to
    save_interval: int | None = None  # iterations between checkpoints (and one at the end)
    load: str | None = None  # directory to resume from (its latest checkpoint)
    # Megatron's: skip --load's optimizer state (and fp16 loss scale), or its random streams;
    # --finetune loads the model weights only and starts at iteration 0.
    no_load_optim: bool = False
    no_load_rng: bool = False
    finetune: bool = False
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
        return "1f1b" if self.num_layers_per_virtual_pipeline_stage is None else "interleaved"

    @property
    def chunks(self) -> int:
        """Model chunks per pipeline rank (v): zb-v's V takes two, each half a stage's layers."""
        if self.schedule == "zb-v":
            return 2
        per = self.num_layers_per_virtual_pipeline_stage
        return 1 if per is None else self.num_layers // (self.pp * per)

    @property
    def decay_iters(self) -> float:
        """--lr-decay-iters, or --lr-decay-samples (or --train-samples) in global batches, as
        Megatron's scheduler counts samples; else --train-iters."""
        samples = self.lr_decay_samples or self.train_samples
        if samples is not None:
            return samples / self.global_batch_size
        return self.lr_decay_iters or self.train_iters

    @property
    def warmup_iters(self) -> float:
        """Warm-up iterations: --lr-warmup-iters, or --lr-warmup-fraction of the decay
        iterations (not rounded, as Megatron's), or the default run's."""
        if self.lr_warmup_fraction is not None:
            return self.lr_warmup_fraction * self.decay_iters
        if self.lr_warmup_samples:
            return self.lr_warmup_samples / self.global_batch_size
        if self.train_samples is not None and self.lr_warmup_iters is None:
            return 0  # Megatron's default; samples-based runs never had megart's default run
        return DEFAULT_WARMUP_ITERS if self.lr_warmup_iters is None else self.lr_warmup_iters

    def learning_rate(self, iteration: float, step: float = 1.0) -> float:
        """The rate of ``iteration`` (0-based; with ``step``, counted in global batches: see
        megart.training.lr) under --lr-decay-style."""
        return learning_rate(
            iteration,
            self.lr,
            self.min_lr,
            self.warmup_iters,
            self.decay_iters,
            self.lr_decay_style,
            step,
        )

    def gpt_config(self) -> GPTConfig:
        """The model these flags describe, Megatron's spellings mapped to GPTConfig's names;
        bad flag combinations are refused first, naming the flags."""
        self._check_model_flags()
        recompute = self.recompute_granularity or (
            "selective" if self.recompute_activations else None
        )
        return GPTConfig(
            vocab_size=self.vocab_size,
            seq_length=self.seq_length,
            hidden_size=self.hidden_size,
            num_layers=self.num_layers,
            num_attention_heads=self.num_attention_heads,
            ffn_hidden_size=self._ffn_hidden_size(),
            hidden_dropout=self.hidden_dropout,
            attention_dropout=self.attention_dropout,
            layernorm_epsilon=self.layernorm_epsilon,
            normalization=NORMALIZATIONS[self.normalization],
            position_embedding=POSITION_EMBEDDING_TYPES[self.position_embedding_type],
            activation="swiglu" if self.swiglu else "gelu",
            bias=not self.disable_bias_linear,
            untie_embeddings_and_output_weights=self.untie_embeddings_and_output_weights,
            num_query_groups=self.num_query_groups if self.group_query_attention else None,
            rotary_base=float(self.rotary_base),
            rotary_interleaved=self.rotary_interleaved,
            attention_backend=self.attention_backend,
            init_std=self.init_method_std,
            seed=self.seed,
            bias_gelu_fusion=self.bias_gelu_fusion,
            fused_layer_norm=self.fused_layer_norm,
            cross_entropy_loss_fusion=self.cross_entropy_loss_fusion,
            recompute_granularity=recompute,
            recompute_method=self.recompute_method,
            recompute_num_layers=self.recompute_num_layers,
        )

    def _ffn_hidden_size(self) -> int | None:
        """--ffn-hidden-size; with --swiglu and none given, Megatron's int(4h * 2/3 / 64) * 64
        (two of SwiGLU's three matrices in the parameters of GeLU's two, rounded down to a
        multiple of 64); otherwise None (GPTConfig's 4 h, as checkpoints have recorded it)."""
        if self.ffn_hidden_size is None and self.swiglu:
            return self.hidden_size // 24 * 64  # the same integer, without float rounding
        return self.ffn_hidden_size

    def microbatches(self, dp: int) -> int:
        return self.global_batch_size // (self.micro_batch_size * dp)

    def check(self, world_size: int) -> int:
        """Refuses layouts, batch shapes and flag combinations that cannot run, naming the
        numbers and flags and what would fit; returns the data-parallel size."""
        tp, pp = self.tp, self.pp
        if tp < 1 or pp < 1 or world_size % (tp * pp):
            raise ConfigError(
                f"{world_size} process{'es do' if world_size > 1 else ' does'} not split into "
                f"tensor-parallel {tp} x pipeline-parallel {pp}; the product must divide the "
                f"number of processes: start a multiple of {max(1, tp * pp)} (torchrun "
                "--nproc-per-node N starts N) or choose smaller sizes"
            )
        dp = world_size // (tp * pp)
        if self.micro_batch_size < 1 or self.global_batch_size < 1:
            raise ConfigError(
                f"--micro-batch-size {self.micro_batch_size} and --global-batch-size "
                f"{self.global_batch_size} must be at least 1"
            )
        if self.distributed_timeout_minutes <= 0:
            raise ConfigError(
                f"--distributed-timeout-minutes {self.distributed_timeout_minutes} must be above 0"
            )
        per_step = self.micro_batch_size * dp
        if self.global_batch_size % per_step:
            below = self.global_batch_size // per_step * per_step
            options = f"{below} or {below + per_step}" if below else f"{per_step}"
            raise ConfigError(
                f"--global-batch-size {self.global_batch_size} is not divisible by "
                f"--micro-batch-size {self.micro_batch_size} x data-parallel size {dp} = "
                f"{per_step}; use a global batch of {options}"
            )
        per = self.num_layers_per_virtual_pipeline_stage
        self._check_schedule(dp)
        check_rampup(self, dp)
        if per is not None:
            if pp < 2:
                raise ConfigError(
                    "--num-layers-per-virtual-pipeline-stage needs "
                    "--pipeline-model-parallel-size of at least 2"
                )
            check_virtual_stages(self.num_layers, pp, per)
            m = self.microbatches(dp)
            if m % pp:
                raise ConfigError(
                    f"the interleaved schedule needs the number of microbatches ({m} = global "
                    f"batch {self.global_batch_size} / (micro batch {self.micro_batch_size} x "
                    f"data-parallel {dp})) to be a multiple of the pipeline size ({pp}); use a "
                    f"global batch of {per_step * pp * max(1, m // pp)} or "
                    f"{per_step * pp * (m // pp + 1)}"
                )
        elif self.num_layers % pp:
            raise ConfigError(
                f"--num-layers {self.num_layers} is not divisible by "
                f"--pipeline-model-parallel-size {pp}"
            )
        if self.sequence_parallel and self.seq_length % tp:
            raise ConfigError(
                f"--sequence-parallel splits --seq-length {self.seq_length} over "
                f"tensor-parallel size {tp}; it must divide"
            )
        if self.train_iters < 1 or self.log_interval < 1:
            raise ConfigError("--train-iters and --log-interval must be at least 1")
        if self.eval_iters < 0 or self.eval_interval < 1:
            raise ConfigError(
                f"--eval-iters {self.eval_iters} must be at least 0 (0: no evaluation) and "
                f"--eval-interval {self.eval_interval} at least 1"
            )
        split_weights(self.split)
        if self.bf16 and self.fp16:
            raise ConfigError("--bf16 and --fp16 exclude each other; choose one")
        if self.save_interval is not None and (self.save_interval < 1 or not self.save):
            raise ConfigError(
                f"--save-interval {self.save_interval} needs --save DIR and a value of at least 1"
            )
        if (self.exit_interval is not None and self.exit_interval < 1) or (
            self.exit_duration_in_mins is not None and self.exit_duration_in_mins < 0
        ):
            raise ConfigError(
                f"--exit-interval {self.exit_interval} must be at least 1 and "
                f"--exit-duration-in-mins {self.exit_duration_in_mins} at least 0 (leave them "
                "out to train all --train-iters)"
            )
        given = [f for f in ("no_load_optim", "no_load_rng", "finetune") if getattr(self, f)]
        if given and not self.load:
            flags = " and ".join("--" + f.replace("_", "-") for f in given)
            raise ConfigError(f"{flags} choose what --load DIR restores; give --load DIR")
        self._check_lr_flags()
        check_megatron_flags(self)
        self.gpt_config().check_layout(tp, pp, self.chunks)  # what GPTConfig refuses, too
        return dp

    def _check_schedule(self, dp: int) -> None:
        """Refuses --pipeline-schedule combinations that cannot run, saying what would."""
        name, per, pp = self.pipeline_schedule, self.num_layers_per_virtual_pipeline_stage, self.pp
        check_schedule_flags(name, per)
        if name == "interleaved" and per is None:
            raise ConfigError(
                "--pipeline-schedule interleaved needs --num-layers-per-virtual-pipeline-stage "
                "(the layers of each model chunk)"
            )
        if self.schedule != "zb-v":
            return
        if self.num_layers % (2 * pp):
            raise ConfigError(
                f"--pipeline-schedule zb-v splits each pipeline stage into two chunks: "
                f"--num-layers {self.num_layers} must be divisible by 2 x pipeline size {pp}; "
                f"use a multiple of {2 * pp} layers, or zb-h1"
            )
        m = self.microbatches(dp)
        if m < 2 * pp:
            per_step = self.micro_batch_size * dp
            raise ConfigError(
                f"--pipeline-schedule zb-v needs at least 2 x pipeline size = {2 * pp} "
                f"microbatches, got {m} (global batch {self.global_batch_size} / (micro batch "
                f"{self.micro_batch_size} x data-parallel {dp})); use a global batch of at least "
                f"{2 * pp * per_step}, or zb-h1"
            )

    def _check_lr_flags(self) -> None:
        check_decay_style(self.lr_decay_style)
        fraction, iters = self.lr_warmup_fraction, self.lr_warmup_iters
        if fraction is not None and iters:
            raise ConfigError(
                f"--lr-warmup-fraction {fraction} and --lr-warmup-iters {iters} exclude each "
                "other (as in Megatron-LM); give one of them"
            )
        if fraction is not None and not 0 <= fraction < 1:
            raise ConfigError(
                f"--lr-warmup-fraction {fraction} must be at least 0 and below 1 (a fraction of "
                f"the {self.decay_iters} decay iterations)"
            )
        if iters is not None and iters < 0:
            raise ConfigError(f"--lr-warmup-iters {iters} must be at least 0")

    def _check_model_flags(self) -> None:
        """Refuses architecture flags that cannot go together, naming them."""
        for name, allowed in (
            ("normalization", NORMALIZATIONS),
            ("position_embedding_type", POSITION_EMBEDDING_TYPES),
        ):
            if getattr(self, name) not in allowed:
                raise ConfigError(
                    f"--{name.replace('_', '-')} {getattr(self, name)!r}; use one of "
                    f"{', '.join(allowed)} (Megatron-LM's spellings)"
                )
        if self.fused_layer_norm and self.normalization != "LayerNorm":
            raise ConfigError(
                f"--fused-layer-norm is a LayerNorm kernel: leave it out with --normalization "
                f"{self.normalization}"
            )
        unfusable = [f for f in ("swiglu", "disable_bias_linear") if getattr(self, f)]
        if self.bias_gelu_fusion and unfusable:
            flags = " and ".join("--" + f.replace("_", "-") for f in unfusable)
            raise ConfigError(
                f"--bias-gelu-fusion fuses the MLP's bias add and GeLU: leave it out with {flags}"
            )
        ffn = self._ffn_hidden_size()
        if ffn is not None and ffn < 1:
            why = (
                ""
                if self.ffn_hidden_size is not None
                else (
                    f" (--swiglu's default for --hidden-size {self.hidden_size}, Megatron's "
                    "int(8h/3 / 64) * 64)"
                )
            )
            raise ConfigError(f"the MLP size {ffn}{why} must be positive; give --ffn-hidden-size")
        if ffn is not None and ffn % self.tp:
            raise ConfigError(
                f"the MLP size {ffn} (--ffn-hidden-size) does not split over "
                f"--tensor-model-parallel-size {self.tp}; use a multiple of {self.tp}"
            )
        self._check_query_groups()
        head = self.hidden_size // max(1, self.num_attention_heads)
        if self.position_embedding_type == "rope" and head % 2:
            raise ConfigError(
                f"--position-embedding-type rope rotates pairs of a head's dimensions, but "
                f"--hidden-size {self.hidden_size} / --num-attention-heads "
                f"{self.num_attention_heads} = {head} is odd; use an even head size"
            )
        if self.init_method_std < 0 or self.layernorm_epsilon <= 0:
            raise ConfigError(
                f"--init-method-std {self.init_method_std} must be at least 0 and "
                f"--layernorm-epsilon {self.layernorm_epsilon} positive"
            )

    def _check_query_groups(self) -> None:
        # max: a tensor-parallel size below 1 is check()'s to refuse, not a division by zero.
        groups, heads, tp = self.num_query_groups, self.num_attention_heads, max(1, self.tp)
        if not self.group_query_attention:
            if groups is not None:
                raise ConfigError(
                    f"--num-query-groups {groups} is used only with --group-query-attention "
                    "(as in Megatron-LM); add that flag, or leave --num-query-groups out for "
                    "multi-head attention"
                )
            return
        if groups is None:
            raise ConfigError(
                "--group-query-attention needs --num-query-groups N, the number of key/value "
                "heads (Megatron-LM's default, 1, is multi-query attention: give 1 for that)"
            )
        if groups < 1 or heads % groups or groups % tp:
            fits = ", ".join(str(g) for g in divisors(heads) if g % tp == 0)
            raise ConfigError(
                f"--num-query-groups {groups} must divide --num-attention-heads {heads} and be "
                f"divisible by --tensor-model-parallel-size {tp} (each rank holds whole "
                "groups, as Megatron-LM requires); "
                + (f"use one of {fits}" if fits else "no group count fits: change the sizes")
            )


def check_schedule_flags(name: str | None, per: int | None) -> None:
    """Refuses a --pipeline-schedule that is unknown or cannot take
    --num-layers-per-virtual-pipeline-stage ``per`` (megart plan checks this too)."""
    if name is not None and name not in PIPELINE_SCHEDULES:
        raise ConfigError(
            f"--pipeline-schedule {name} is not one of {', '.join(PIPELINE_SCHEDULES)}"
        )
    if name in ("1f1b", "zb-h1", "zb-v") and per is not None:
        what = (
            "derives its two chunks from the layers per stage"
            if name == "zb-v"
            else ("runs one model chunk per rank")
        )
        raise ConfigError(
            f"--pipeline-schedule {name} {what}: leave out "
            f"--num-layers-per-virtual-pipeline-stage {per}, or use the interleaved schedule"
        )


def check_virtual_stages(num_layers: int, pp: int, per: int) -> None:
    """--num-layers-per-virtual-pipeline-stage must split the layers evenly over the pipeline
    ranks' chunks; the error lists the values that would."""
    if per >= 1 and num_layers % (pp * per) == 0:
        return
    fits = [v for v in range(1, num_layers // pp + 1) if num_layers % (pp * v) == 0]
    hint = (
        f"values that fit: {', '.join(map(str, fits))}"
        if fits
        else f"--num-layers must be a multiple of {pp}"
    )
    raise ConfigError(
        f"--num-layers {num_layers} is not divisible by pipeline size {pp} x "
        f"--num-layers-per-virtual-pipeline-stage {per}; {hint} (layers per model chunk: each "
        f"of the {pp} pipeline ranks holds num_layers / ({pp} x value) chunks)"
    )


def split_weights(split: str) -> tuple[float, float, float]:
    """--split "969,30,1" (or "90,10"; missing weights are 0) as fractions of the corpus."""
    try:
        weights = [float(w) for w in split.replace("/", ",").split(",")]
    except ValueError:
        weights = []
    if not 1 <= len(weights) <= 3 or min(weights) < 0 or weights[0] <= 0:
        raise ConfigError(
            f"--split {split!r}: give up to three non-negative weights for train, validation "
            "and test, with a positive train weight, e.g. --split 969,30,1"
        )
    weights += [0.0] * (3 - len(weights))
    total = sum(weights)
    return weights[0] / total, weights[1] / total, weights[2] / total
