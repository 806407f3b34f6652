"""Megatron-LM's flags that megart's own flags did not already cover, so that Megatron's GPT
scripts run unchanged under ``megart train``: what each means here, and the checks that refuse,
naming the flag, what megart cannot do (yet).

What each does in megart:
- --max-position-embeddings: the learned position table's rows; megart's table has
  --seq-length rows, so a learned table must be exactly that long (rope has no table).
- --kv-channels: the head size, which megart takes as --hidden-size / --num-attention-heads.
- --rotary-base, --rotary-interleaved: rope's base and which pairs turn (see GPTConfig).
- --use-rope-scaling, --rope-scaling-factor (default 8.0): Llama 3.x's scaling of rope's
  frequencies, as Megatron-Core's RotaryEmbedding and Hugging Face's rope type llama3 (see
  GPTConfig.rope_scaling); a factor other than 8.0 without --use-rope-scaling is refused
  (Megatron ignores it), as is --use-rope-scaling without --position-embedding-type rope.
- --rotary-seq-len-interpolation-factor F: position interpolation, rope's positions divided by
  F, as Megatron-Core's RotaryEmbedding and Hugging Face's rope type linear (see
  GPTConfig.rotary_seq_len_interpolation_factor); with --use-rope-scaling both apply, as in
  Megatron-Core. Refused without --position-embedding-type rope and for F <= 0.
- --attention-backend: auto, flash and fused let torch's scaled_dot_product_attention pick its
  kernel; unfused and local run its math kernel (the explicit s x s scores).
- --tokenizer-type GPT2BPETokenizer (--vocab-file, --merge-file; implied by those two, as the
  GPT example scripts assume), HuggingFaceTokenizer (--tokenizer-model), NullTokenizer
  (--vocab-size, plus one for its end-of-document id): the model's vocabulary is the
  tokenizer's (padded to a multiple of 128 t, as Megatron pads it). Token ids come already
  tokenized in --data-path's .bin files, so training needs nothing else from the tokenizer.
- --train-data-path, --valid-data-path, --test-data-path: a dataset (or blend, in --data-path's
  forms) per split, read whole, instead of --data-path cut by --split
  (megart.training.data.build_split_datasets); with --data-path, --mock-data or --split, or
  without --train-data-path, refused (megart.training.config_checks).
- --mock-data: random tokens of the vocabulary (seeded by --seed) instead of a corpus.
- --num-workers: accepted and checked; megart reads samples in the training process from
  memory-mapped files, with no loader workers to start.
- --no-mmap-bin-files: reads the .bin files into memory instead of mapping them.
- --no-create-attention-mask-in-dataloader: megart never builds a mask in the loader (the
  attention kernels mask causally), so both settings train the same model; with
  --reset-attention-mask it is refused (Megatron then has no mask to reset).
- --train-samples, --lr-decay-samples, --lr-warmup-samples: Megatron's formulas: train_iters =
  train_samples // global batch; the schedule counts samples, that is iterations times the
  global batch (see TrainConfig.decay_iters and warmup_iters).
- --rampup-batch-size: Megatron's batch-size ramp-up (megart.training.batch_rampup).
- --overlap-grad-reduce (megart's default) / --no-overlap-grad-reduce, --overlap-param-gather:
  see megart.training.grad_sync and megart.training.distributed_optimizer.
- --ddp-bucket-size, --ddp-num-buckets: Megatron's gradient bucket size in elements (with N
  buckets: this rank's parameters // N), for megart's buckets on every stage and chunk, and for
  the buffers of Megatron-format distrib_optim.pt files as Megatron lays them out (bucketed on
  the first stage's first chunk only); both together, or N < 1, are refused as Megatron does.
- --distributed-timeout-minutes: the bound on every wait of megart's communicator.
- --log-throughput: megart's progress line always has TFLOP/s per GPU (Megatron's count).
- --add-qkv-bias: the fused q/k/v projection keeps its bias under --disable-bias-linear, as
  Megatron-Core's add_qkv_bias (sharded by query group with the weight); Hugging Face's Qwen2
  format holds it, the others refuse it.
- --qk-layernorm: each query and key head normalised before rope, as Megatron-Core's
  q_layernorm/k_layernorm (megart.models.attention.Attention); Hugging Face's Llama and GPT-2
  formats have no such norms, so export-hf refuses such a model.
- --non-persistent-save-interval, --non-persistent-ckpt-type global,
  --non-persistent-global-ckpt-dir, --async-save: megart.training.save_modes.
- --save-retain-interval N: Megatron's rule: once a checkpoint is complete, the one saved before
  it is deleted unless its iteration is a multiple of N (megart.training.checkpoint_dirs.retire).
- --timing-log-level, --timing-log-option, --log-timers-to-tensorboard: Megatron's per-phase
  timers where megart has the phase (megart.training.timers).
- --log-params-norm, --log-num-zeros-in-grad, --log-world-size-to-tensorboard: Megatron's
  params-norm, num-zeros and world-size figures, in the progress line (the first two) and under
  --tensorboard-dir (megart.training.iteration_stats).
- --log-memory-to-tensorboard: Megatron's mem-* scalars under --tensorboard-dir on CUDA
  (megart.training.memory_report); on CPU there is no CUDA allocator, so it writes none.
- --ckpt-format: megart (the default); torch writes Megatron-LM's legacy format
  (megart.training.megatron_files; with --use-distributed-optimizer also each rank's
  distrib_optim.pt, megart.training.megatron_distrib_optim), torch_dist writes Megatron's
  distributed format, the whole training state (megart.training.megatron_dist_train; with
  --use-distributed-optimizer its state as Megatron's dp_reshardable buckets,
  megart.training.megatron_dist_distopt; not under zb-v; torch is not written under zb-v,
  whose V Megatron-LM's legacy files cannot place). --load
  resumes a Megatron-LM legacy checkpoint of any layout in full (megart.training.megatron_file_read;
  as --finetune when it holds no optimizer) and resumes a torch_dist checkpoint of the
  non-distributed optimizer's keys, or the distributed optimizer's (dp_reshardable), into any
  layout, --use-distributed-optimizer's included (megart.training.megatron_dist_train_load; weights
  alone with --finetune or --no-load-optim).
- --eod-mask-loss, --reset-position-ids, --reset-attention-mask: documents inside a sample,
  cut at the tokenizer's end-of-document token, as Megatron-Core's GPTDataset
  (megart.models.documents, megart.training.documents; refused where the data has no
  tokenizer, and --reset-attention-mask under context parallelism).
- --calculate-per-token-loss: the gradient of the global batch's loss sum over its token
  count, where Megatron's default is the mean of the microbatches' means; without
  --eod-mask-loss every microbatch has b s tokens and the two are the same.
- --context-parallel-size: each sequence split over cp ranks, K and V all-gathered
  (megart.models.context_parallel); what it does not combine with yet is refused by name
  (megart.training.context_parallel_checks).
- --window-size LEFT,RIGHT, --window-attn-skip-freq: sliding-window attention, each token
  attending to itself and the LEFT tokens before it, in every layer or those the pattern picks
  (megart.models.window); RIGHT must be 0 (the attention is causal). Megatron's FLOP count,
  and megart's, ignore the window (its attention FLOPs are counted as full causal ones).
- --init-method-xavier-uniform: every weight (embeddings and output projections included)
  from Glorot's uniform with the whole tensor's fans (megart.models.init says why: Megatron-LM
  itself fails with this flag since 2023).
- --expert-model-parallel-size: expert parallelism with the expert tensor-parallel size equal
  to the tensor-parallel size (Megatron's default), saving megart's format only (megart.
  training.expert_checks).
- --decoupled-lr, --decoupled-min-lr: the embedding's and output layer's own param group
  (megart.training.optimizer.param_groups), scheduled with its own peak and floor.
- --grad-reduce-in-bf16 (with --bf16): the gradient buckets travel in bf16
  (megart.training.grad_sync); Megatron's checkpoints then record a bf16 gradient buffer.
- --accumulate-allreduce-grads-in-fp32: megart's gradients are fp32 from backward to the step
  and averaged over data parallelism in fp32 with or without it (Megatron's --fp16 default
  accumulates and averages them in fp16), so the flag holds already; --ckpt-format torch files
  record it, and with --fp16 their distrib_optim.pt buffer key is then (fp16, fp32), as Megatron's.
- --use-mcore-models: deprecated in Megatron-LM, where Megatron-Core's GPTModel is the only GPT;
  megart's model and its Megatron checkpoints are that model's, so the switch holds already.
- --apply-layernorm-1p: every norm's weight zero-centred (initialised to 0, applied as
  1 + weight), as Megatron's layernorm_zero_centered_gamma; see GPTConfig.apply_layernorm_1p.
- --rotary-percent p: partial rotary, rope turning only the first int(head size x p) channels
  of each query and key head (with --rotary-interleaved, adjacent pairs among them), as
  Megatron-Core's RotaryEmbedding (see GPTConfig.rotary_percent); refused without
  --position-embedding-type rope, outside (0, 1], and where that channel count is odd or 0.
  Tested against Megatron-Core's rope and GPTModel (tests/test_rotary_percent.py).
- --data-cache-path: where Megatron writes its datasets' index files; megart draws samples as a
  function of the seed and iteration and writes none, so there is nothing to put there.
- --tiktoken-pattern: an option of TikTokenizer, which megart does not take (--tokenizer-type
  refuses it), so it changes nothing, as in Megatron with any other tokenizer.
- --manual-gc, --manual-gc-interval, --no-manual-gc-eval, --empty-unused-memory-level,
  --profile, --profile-step-start, --profile-step-end, --use-pytorch-profiler, --profile-ranks,
  --pytorch-profiler-collect-shapes, --pytorch-profiler-collect-callstack: what Megatron-LM
  does around each iteration, done at the same points (megart.training.housekeeping).
- --make-vocab-size-divisible-by N (default 128): the vocabulary padded to a multiple of N t,
  Megatron's vocab_size_with_padding (GPTConfig.padded_vocab_size); padded rows stay zero and
  out of the loss, so N changes no loss, and a checkpoint resumes under another N (resharded).
- --pretrained-checkpoint DIR: where --load holds no checkpoint (a restartable fine-tuning job's
  first run), DIR's weights from iteration 0, as --finetune (trainer_setup.pretrained_start).
- --use-flash-attn: Megatron's older switch, --attention-backend flash. --transformer-impl
  (local, transformer_engine): megart's own layers compute Megatron-Core's GPT either way.
  --optimizer adam: Megatron's Adam is AdamW (decoupled weight decay), as megart's; others are
  refused by argparse's choices.
- --tensorboard-log-interval N: training scalars every N iterations, evaluations always, as
  Megatron writes them; --log-validation-ppl-to-tensorboard: megart writes them always.
- FUSIONS_OFF: Megatron's switches that turn a fused kernel off (each named below).
- The Megatron-LM flags megart cannot honour are refused by name, each with why and what to do
  instead: megart.training.megatron_refusals.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from megart.errors import ConfigError
from megart.models.window import as_flag_text
from megart.training.batch_rampup import check_values
from megart.training.batch_rampup import train_iters as ramp_train_iters
from megart.training.grad_sync import megatron_bucket_size

ATTENTION_BACKENDS = ("auto", "flash", "fused", "unfused", "local")
TOKENIZER_TYPES = ("GPT2BPETokenizer", "HuggingFaceTokenizer", "NullTokenizer")
CKPT_FORMATS = ("megart", "torch", "torch_dist")
MOCK_TOKENS = 1 << 20  # tokens of --mock-data's corpus
# Megatron-LM's switches that turn one of its fused kernels off, with what each means here. A
# kernel choice never changes the math, so megart accepts each: --no-bias-gelu-fusion sets
# megart's own bias-GeLU fusion off (on by default, as Megatron's), and the others turn off
# fusions that megart does not have, so they change nothing. (--no-gradient-accumulation-fusion
# is TrainConfig's own switch: see its help in megart.cli.train.)
FUSIONS_OFF = {
    "--no-bias-gelu-fusion": "the MLP's bias add and GeLU unfused (megart's fused kernel is "
    "on by default where the MLP has them, as in Megatron-LM)",
    "--no-masked-softmax-fusion": "accepted: megart's attention is torch's "
    "scaled_dot_product_attention, never Megatron's fused masked softmax",
    "--no-bias-swiglu-fusion": "accepted: megart's SwiGLU MLP has no fused bias-SwiGLU kernel",
    "--no-bias-dropout-fusion": "accepted: megart adds bias, dropout and residual unfused",
    "--no-rope-fusion": "accepted: megart's rope is plain torch, never a fused rope kernel",
    "--no-persist-layer-norm": "accepted: megart has no persistent LayerNorm kernel (apex's)",
}


class ResolvedVocabulary(int):
    """--vocab-size once resolved from ``kind``'s tokenizer: TrainConfig resolves the tokenizer's
    vocabulary in __post_init__, which dataclasses.replace runs again on the resolved value, and
    NullTokenizer's adds its end-of-document id to --vocab-size; given this, it adds nothing
    again. An int everywhere else; what is saved takes int() of it (the model's config, the
    checkpoints' args: torch's weights-only loading takes no other class)."""

    kind: str

    def __new__(cls, size: int, kind: str = "") -> ResolvedVocabulary:
        resolved = super().__new__(cls, size)
        resolved.kind = kind
        return resolved


def tokenizer_vocab_size(config: Any) -> int | None:
    """The vocabulary of --tokenizer-type (None when no tokenizer is given), loaded through
    the ``tokenizers`` and ``transformers`` libraries."""
    kind = config.tokenizer_type
    if kind is None and (config.vocab_file or config.merge_file):
        kind = "GPT2BPETokenizer"  # what Megatron's GPT example scripts give files for
    if kind is None:
        return None
    if kind == "GPT2BPETokenizer":
        if not (config.vocab_file and config.merge_file):
            raise ConfigError(
                "--tokenizer-type GPT2BPETokenizer needs --vocab-file (gpt2-vocab.json) and "
                "--merge-file (gpt2-merges.txt)"
            )
        from tokenizers import Tokenizer
        from tokenizers.models import BPE

        try:
            bpe = Tokenizer(BPE.from_file(config.vocab_file, config.merge_file))
            return bpe.get_vocab_size()
        except Exception as e:  # the library's errors name the file
            raise ConfigError(f"--vocab-file/--merge-file: {e}") from e
    if kind == "HuggingFaceTokenizer":
        if not config.tokenizer_model:
            raise ConfigError(
                "--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model (a Hugging Face "
                "tokenizer directory or name)"
            )
        return len(hf_tokenizer(config.tokenizer_model))
    if kind == "NullTokenizer":
        if getattr(config.vocab_size, "kind", None) == kind:  # resolved already (a copy's)
            return config.vocab_size
        return config.vocab_size + 1  # Megatron's: ids below --vocab-size, then end-of-document
    raise ConfigError(f"--tokenizer-type {kind!r}; megart takes {', '.join(TOKENIZER_TYPES)}")


@functools.lru_cache(maxsize=4)
def hf_tokenizer(name_or_dir: str) -> Any:
    """The Hugging Face tokenizer --tokenizer-model names, loaded once per process: the
    vocabulary's size and the document flags' end-of-document id both read it."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(name_or_dir)
    except Exception as e:  # the library's errors name the model
        raise ConfigError(f"--tokenizer-model {name_or_dir}: {e}") from e


def resolve_megatron_flags(config: Any) -> None:
    """What the flags decide for the rest of the config: the tokenizer's vocabulary,
    --train-samples' iterations, and --loss-scale 0 meaning a dynamic scale."""
    if config.use_flash_attn:  # Megatron's older switch for its flash-attention kernel
        if config.attention_backend not in ("auto", "flash"):
            raise ConfigError(
                f"--use-flash-attn with --attention-backend {config.attention_backend}: give "
                "one of them"
            )
        config.attention_backend = "flash"
    if config.tensorboard_log_interval < 1:
        raise ConfigError(
            f"--tensorboard-log-interval {config.tensorboard_log_interval}: give 1 or more "
            "(iterations between TensorBoard scalars)"
        )
    # The Python API also takes the window as Megatron-Core's TransformerConfig does.
    config.window_size, config.window_attn_skip_freq = as_flag_text(
        config.window_size, config.window_attn_skip_freq
    )
    if config.loss_scale == 0:
        # Megatron-LM builds its dynamic scaler unless the scale is truthy (`if
        # config.loss_scale:` in megatron/core/optimizer), so 0 asks for the dynamic scale.
        config.loss_scale = None
    vocab = tokenizer_vocab_size(config)
    if vocab is not None:
        config.vocab_size = ResolvedVocabulary(vocab, config.tokenizer_type or "GPT2BPETokenizer")
    check_values(config)  # before the ramp's iterations are counted
    if config.train_samples is not None and config.global_batch_size > 0:
        config.train_iters = (
            config.train_samples // config.global_batch_size
            if config.rampup_batch_size is None
            else ramp_train_iters(config)
        )


def check_megatron_flags(config: Any) -> None:
    """Refuses, naming the flag, what megart cannot do or what Megatron would refuse."""
    distopt_store = config.ckpt_format == "torch_dist" and config.use_distributed_optimizer
    if distopt_store and config.save and config.schedule == "zb-v":
        # The distributed optimizer's torch_dist state follows Megatron's buffers of each
        # model chunk (megart.training.megatron_dist_distopt); zb-v's V puts other layers in
        # a rank's chunks than any Megatron layout does.
        raise ConfigError(
            "--ckpt-format torch_dist with --use-distributed-optimizer, --save and "
            "--pipeline-schedule zb-v: the distributed optimizer's state in that format follows "
            "Megatron's model chunks, which zb-v's V placement does not have; leave out "
            "--use-distributed-optimizer (the store then holds the whole tensors), or save "
            "--ckpt-format megart (the default)"
        )
    if config.ckpt_format == "torch" and config.save and config.schedule == "zb-v":
        # Megatron-LM's legacy files hold a rank's chunks as model0, model1, ..., chunk c of
        # rank r being virtual stage c p + r; zb-v's V puts stages r and 2p - 1 - r on rank r,
        # and its args (no interleaving) build one model per rank: Megatron-LM cannot load them.
        raise ConfigError(
            "--ckpt-format torch with --save and --pipeline-schedule zb-v: Megatron-LM's legacy "
            "files place a rank's model chunks as its interleaving does (chunk c of rank r is "
            "stage c x pipeline size + r), not in zb-v's V (rank r holds stages r and "
            "2 x pipeline size - 1 - r), so Megatron-LM could not load them; save --ckpt-format "
            "torch_dist (its tensors are placed by layer, for any layout; without "
            "--use-distributed-optimizer) or megart (the default; megart convert-checkpoint "
            "--to megatron then writes Megatron's placement), or use --pipeline-schedule "
            "interleaved"
        )
    s = config.seq_length
    most = config.max_position_embeddings
    learned = config.position_embedding_type == "learned_absolute"
    if most is not None and (most < s or (learned and most != s)):
        raise ConfigError(
            f"--max-position-embeddings {most} with --seq-length {s}: megart's learned "
            "position table has exactly --seq-length rows (give the same number), and no "
            "position embedding may be shorter than the sequence"
        )
    _check_housekeeping(config)
    if config.rotary_base < 1:
        raise ConfigError(f"--rotary-base {config.rotary_base} must be at least 1")
    if config.rope_scaling_factor != 8.0 and not config.use_rope_scaling:
        raise ConfigError(
            f"--rope-scaling-factor {config.rope_scaling_factor:g} scales rope only with "
            "--use-rope-scaling: add it (Megatron ignores the factor without; megart refuses "
            "rather than ignore it)"
        )
    if config.num_workers < 0:
        raise ConfigError(f"--num-workers {config.num_workers} must be at least 0")
    if config.mock_data and config.data_path:  # the per-split paths: config_checks
        raise ConfigError("--mock-data and --data-path exclude each other; give one")
    _check_samples(config)
    if config.decoupled_min_lr is not None and config.decoupled_lr is None:
        raise ConfigError(
            "--decoupled-min-lr is the floor of --decoupled-lr's group: give --decoupled-lr "
            "too (Megatron ignores it without; megart refuses rather than ignore it)"
        )
    if config.grad_reduce_in_bf16 and not config.bf16:
        raise ConfigError(
            "--grad-reduce-in-bf16 reduces a --bf16 run's gradients in bf16: add --bf16 (Megatron "
            "ignores it without; megart refuses rather than ignore it)"
        )
    # What Megatron-LM refuses of the bucket flags (both given, no bucket), said before a run.
    megatron_bucket_size(0, 1, config.ddp_bucket_size, config.ddp_num_buckets)
    if config.overlap_param_gather and not config.use_distributed_optimizer:
        raise ConfigError(
            "--overlap-param-gather overlaps the distributed optimizer's all-gather: add "
            "--use-distributed-optimizer (as Megatron-LM requires)"
        )


def _check_housekeeping(config: Any) -> None:
    if config.manual_gc_interval < 0:
        raise ConfigError(f"--manual-gc-interval {config.manual_gc_interval} must be at least 0")
    if not config.profile:
        return
    start, end = config.profile_step_start, config.profile_step_end
    if not 0 <= start < end:
        raise ConfigError(
            f"--profile-step-start {start} and --profile-step-end {end}: profiling runs from "
            "the first count to the second, so give 0 <= start < end"
        )
    if config.use_pytorch_profiler and not config.tensorboard_dir:
        raise ConfigError(
            "--use-pytorch-profiler writes its trace beside --tensorboard-dir "
            "(DIR/../torch_profile, as Megatron-LM): give --tensorboard-dir"
        )
    import torch

    if not config.use_pytorch_profiler and not torch.cuda.is_available():
        raise ConfigError(
            "--profile without --use-pytorch-profiler opens a CUDA profiler range for nsys "
            "and needs a CUDA GPU; on CPU add --use-pytorch-profiler (torch's profiler)"
        )


def _check_samples(config: Any) -> None:
    """Megatron's rule: a run counts iterations or samples, never both."""
    by_samples = config.train_samples is not None
    mixed = (
        ["--lr-decay-samples"] * (config.lr_decay_samples is not None)
        + ["--lr-warmup-samples"] * bool(config.lr_warmup_samples)
        + ["--lr-wsd-decay-samples"] * (config.lr_wsd_decay_samples is not None)
        if not by_samples
        else ["--lr-decay-iters"] * (config.lr_decay_iters is not None)
        + ["--lr-warmup-iters"] * bool(config.lr_warmup_iters)
        + ["--lr-wsd-decay-iters"] * (config.lr_wsd_decay_iters is not None)
    )
    if mixed:
        kind = "--train-samples" if by_samples else "--train-iters"
        raise ConfigError(
            f"{' and '.join(mixed)} with {kind}: as in Megatron-LM, a run counts iterations "
            "(--train-iters, --lr-decay-iters, --lr-warmup-iters, --lr-wsd-decay-iters) or "
            "samples (--train-samples, --lr-decay-samples, --lr-warmup-samples, "
            "--lr-wsd-decay-samples), not both"
        )
    if config.lr_warmup_fraction is not None and config.lr_warmup_samples:
        raise ConfigError(
            "--lr-warmup-fraction and --lr-warmup-samples exclude each other; give one"
        )
    if by_samples and config.train_samples < config.global_batch_size:
        raise ConfigError(
            f"--train-samples {config.train_samples} is less than one global batch "
            f"(--global-batch-size {config.global_batch_size})"
        )


def mock_tokens(config: Any) -> np.ndarray:
    """--mock-data's corpus: uniformly random token ids of the vocabulary, from --seed."""
    rng = np.random.default_rng(config.seed)
    return rng.integers(0, config.vocab_size, MOCK_TOKENS, dtype=np.int64)
