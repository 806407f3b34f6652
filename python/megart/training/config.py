"""Training configuration, with Megatron-LM's flag names, and the checks made before any work."""

from __future__ import annotations

from dataclasses import dataclass

from megart.errors import ConfigError


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
    train_iters: int = 40
    lr: float = 3e-3
    min_lr: float = 3e-4
    lr_warmup_iters: int = 4
    lr_decay_iters: int | None = None  # train_iters
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    seed: int = 1234
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    num_layers_per_virtual_pipeline_stage: int | None = None
    sequence_parallel: bool = False
    scatter_gather_tensors_in_pipeline: bool = True
    # Megatron's --use-distributed-optimizer (ZeRO-1): Adam's state sharded over data parallelism.
    use_distributed_optimizer: bool = False
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

    @property
    def tp(self) -> int:
        return self.tensor_model_parallel_size

    @property
    def pp(self) -> int:
        return self.pipeline_model_parallel_size

    @property
    def chunks(self) -> int:
        """Model chunks per pipeline rank (v)."""
        per = self.num_layers_per_virtual_pipeline_stage
        return 1 if per is None else self.num_layers // (self.pp * per)

    def microbatches(self, dp: int) -> int:
        return self.global_batch_size // (self.micro_batch_size * dp)

    def check(self, world_size: int) -> int:
        """Refuses layouts and batch shapes that cannot run, naming the numbers and what would
        fit; returns the data-parallel size."""
        tp, pp = self.tp, self.pp
        if tp < 1 or pp < 1 or world_size % (tp * pp):
            raise ConfigError(
                f"{world_size} processes do not split into tensor-parallel {tp} x "
                f"pipeline-parallel {pp}; the product must divide the world size"
            )
        dp = world_size // (tp * pp)
        per_step = self.micro_batch_size * dp
        if self.micro_batch_size < 1 or self.global_batch_size % per_step:
            below = self.global_batch_size // per_step * per_step
            options = f"{below} or {below + per_step}" if below else f"{per_step}"
            raise ConfigError(
                f"--global-batch-size {self.global_batch_size} is not divisible by "
                f"--micro-batch-size {self.micro_batch_size} x data-parallel size {dp} = "
                f"{per_step}; use a global batch of {options}"
            )
        per = self.num_layers_per_virtual_pipeline_stage
        if per is not None:
            if pp < 2:
                raise ConfigError(
                    "--num-layers-per-virtual-pipeline-stage needs "
                    "--pipeline-model-parallel-size of at least 2"
                )
            if per < 1 or self.num_layers % (pp * per):
                raise ConfigError(
                    f"--num-layers {self.num_layers} is not divisible by pipeline size {pp} x "
                    f"--num-layers-per-virtual-pipeline-stage {per}"
                )
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
        return dp


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
