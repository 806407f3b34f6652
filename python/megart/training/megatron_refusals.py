"""Megatron-LM's flags that megart cannot honour: each is refused by name, with why and what to
do instead, never ignored and never answered with argparse's "did you mean" (which would point
at an unrelated megart flag). tests/data/megatron_flag_names.txt lists every flag of Megatron-LM's
parser; tests/test_megatron_flag_refusals.py checks that megart accepts or refuses each.

A family (FAMILIES, megart.training.megatron_refusal_families) is refused by one reason: a name
ending in "-" there stands for every flag it begins (--moe-, --inference-, ...); the others are
whole names. REFUSED holds the flags with a
reason of their own. The message always names the flag given.
"""

from __future__ import annotations

from megart.training.megatron_refusal_families import FAMILIES

_LEAVE = "leave it out"
_OPT = "megart's optimizer is Adam (AdamW) with fp32 moments and main weights on the GPU; " + _LEAVE
_DEPRECATED = "no longer valid in Megatron-LM either (it refuses it); use "

# The flags with a reason of their own.
REFUSED: dict[str, str] = {
    # Megatron-LM's deprecated flags that it refuses itself.
    "--batch-size": _DEPRECATED + "--micro-batch-size",
    "--warmup": _DEPRECATED + "--lr-warmup-fraction or --lr-warmup-iters",
    "--model-parallel-size": _DEPRECATED + "--tensor-model-parallel-size",
    "--checkpoint-activations": _DEPRECATED
    + "--recompute-activations (or --recompute-granularity and --recompute-method)",
    # Models and layers.
    "--apply-residual-connection-post-layernorm": "megart's residual is taken before the "
    "norm (pre-norm, Megatron's default); " + _LEAVE,
    "--use-fused-weighted-squared-relu": "megart's --squared-relu is not fused (and it has no "
    "MoE's weighted one); " + _LEAVE,
    "--use-te-activation-func": "megart's activations are its own, not Transformer "
    "Engine's; " + _LEAVE,
    "--qk-l2-norm": "megart normalises queries and keys with --qk-layernorm only; " + _LEAVE,
    "--qk-clip": "megart has no QK-clip; " + _LEAVE,
    "--qk-clip-alpha": "megart has no QK-clip; " + _LEAVE,
    "--qk-clip-threshold": "megart has no QK-clip; " + _LEAVE,
    "--log-max-attention-logit": "megart does not track attention logits; " + _LEAVE,
    "--attention-output-gate": "megart's attention has no output gate; " + _LEAVE,
    "--apply-query-key-layer-scaling": "megart's attention is torch's scaled_dot_product_"
    "attention, which does not scale scores by the layer number; " + _LEAVE,
    "--attention-softmax-in-fp32": "megart's attention is torch's scaled_dot_product_attention, "
    "whose softmax precision megart does not choose; " + _LEAVE,
    "--flash-attention-version": "megart's flash kernels are torch's (--attention-backend "
    "flash); " + _LEAVE,
    "--no-rope-freq": "megart applies rope in every layer; " + _LEAVE,
    "--embedding-init-method-std": "megart initialises the embedding with --init-method-std; "
    + _LEAVE,
    "--apply-wd-to-qk-layernorm": "megart never decays norm weights, as Megatron's default; "
    + _LEAVE,
    "--no-weight-decay-cond-type": "megart never decays norm weights and biases, as "
    "Megatron's default; " + _LEAVE,
    "--fp16-lm-cross-entropy": "megart computes the loss in fp32; " + _LEAVE,
    "--output-logit-dtype": "megart's logits take the model's dtype and its loss is fp32; "
    + _LEAVE,
    "--fused-residual-rmsnorm": "megart has no fused residual-RMSNorm kernel; " + _LEAVE,
    "--use-transformer-engine-op-fuser": "megart does not use Transformer Engine; " + _LEAVE,
    "--cross-entropy-fusion-impl": "megart's cross-entropy kernel is its own "
    "(--cross-entropy-loss-fusion); " + _LEAVE,
    "--disable-bf16-reduced-precision-matmul": "megart leaves torch's reduced-precision "
    "matmul setting as it is; " + _LEAVE,
    "--onnx-safe": "megart does not export to ONNX; " + _LEAVE,
    "--account-for-embedding-in-pipeline-split": "megart splits layers with "
    "--decoder-first/last-pipeline-num-layers; use those",
    "--account-for-loss-in-pipeline-split": "megart splits layers with "
    "--decoder-first/last-pipeline-num-layers; use those",
    "--pipeline-model-parallel-layout": "megart places layers with "
    "--decoder-first/last-pipeline-num-layers and --num-layers-per-virtual-pipeline-stage; "
    "use those",
    "--mlp-chunks-for-training": "megart computes each MLP in one piece; " + _LEAVE,
    # Initialisation and determinism.
    "--use-cpu-initialization": "megart initialises each shard on its device; " + _LEAVE,
    "--no-initialization": "megart always initialises the weights (use --load or "
    "--pretrained-checkpoint to start from others)",
    "--deterministic-mode": "megart has no deterministic mode switch; " + _LEAVE,
    "--te-rng-tracker": "megart's random streams are its own, not Transformer Engine's; " + _LEAVE,
    "--data-parallel-random-init": "megart initialises every data-parallel replica alike; "
    + _LEAVE,
    # Parallelism and its overlaps.
    "--pipeline-model-parallel-comm-backend": "megart's pipeline traffic goes over its own "
    "communicator (--distributed-backend); " + _LEAVE,
    "--hierarchical-context-parallel-sizes": "megart's context parallelism is one level "
    "(--context-parallel-size, --cp-comm-type); " + _LEAVE,
    "--max-seqlen-per-dp-cp-rank": "megart has no hybrid context parallelism; " + _LEAVE,
    "--hybrid-context-parallel": "megart has no hybrid context parallelism; " + _LEAVE,
    "--delay-wgrad-compute": "megart does not delay weight gradients outside its zero-bubble "
    "schedules (--pipeline-schedule); " + _LEAVE,
    "--defer-embedding-wgrad-compute": "megart does not defer the embedding's weight "
    "gradient; " + _LEAVE,
    "--wgrad-deferral-limit": "megart does not defer the embedding's weight gradient; " + _LEAVE,
    "--use-ring-exchange-p2p": "megart's pipeline sends are batched point-to-point ops; " + _LEAVE,
    "--overlap-p2p-communication-warmup-flush": "megart has no such pipeline overlap option; "
    + _LEAVE,
    "--no-overlap-p2p-communication": "megart always posts pipeline receives early; " + _LEAVE,
    "--microbatch-group-size-per-virtual-pipeline-stage": "megart's interleaved schedule "
    "groups microbatches by the pipeline size, as Megatron's default; " + _LEAVE,
    "--distribute-saved-activations": "megart does not distribute recomputed layers' inputs "
    "over tensor-parallel ranks; " + _LEAVE,
    "--no-align-grad-reduce": "megart's gradient reduction has no such option; " + _LEAVE,
    "--disable-align-grad-reduce": "megart's gradient reduction has no such option; " + _LEAVE,
    "--no-align-param-gather": "megart's parameter gather has no such option; " + _LEAVE,
    "--ddp-pad-buckets-for-high-nccl-busbw": "megart lays buckets out as Megatron's default; "
    + _LEAVE,
    "--ddp-reduce-scatter-with-fp32-accumulation": "megart's gradients are fp32 already; " + _LEAVE,
    "--ddp-param-name-patterns-for-fp32-local-accumulation": "megart's gradients are fp32 "
    "already; " + _LEAVE,
    "--ddp-average-in-collective": "megart scales gradients before the reduction, as "
    "Megatron's default; " + _LEAVE,
    "--overlap-param-gather-with-optimizer-step": "megart overlaps the parameter gather with "
    "the next forward only (--overlap-param-gather); " + _LEAVE,
    "--use-tp-pp-dp-mapping": "megart's rank order is tensor, data, pipeline (Megatron's "
    "default); " + _LEAVE,
    "--disable-gloo-process-groups": "megart creates no gloo groups to disable; " + _LEAVE,
    "--distributed-timeout-seconds-after-init": "megart's waits are bounded by "
    "--distributed-timeout-minutes; use that",
    "--lazy-mpu-init": "megart initialises its process groups itself; " + _LEAVE,
    "--local-rank": "megart reads LOCAL_RANK from the environment; launch with torchrun",
    "--fake-process-group": "megart has no fake process group; " + _LEAVE,
    "--no-clone-scatter-output-in-embedding": "megart's embedding has no such option; " + _LEAVE,
    "--disable-clone-scatter-output-in-embedding": "megart's embedding has no such option; "
    + _LEAVE,
    "--disable-jit-fuser": "megart's fused kernels are its own, not torch.jit's; " + _LEAVE,
    # Training loop, schedules and evaluation.
    "--step-batch-size-schedule": "megart ramps the batch with --rampup-batch-size; use that",
    "--decrease-batch-size-if-needed": "megart keeps the global batch given; " + _LEAVE,
    "--check-weight-hash-across-dp-replicas-interval": "megart does not hash weights across "
    "replicas; " + _LEAVE,
    "--gpu-sniff-test-interval": "megart has no GPU sniff test; " + _LEAVE,
    "--train-sync-interval": "megart has no such synchronisation interval; " + _LEAVE,
    "--exit-signal-handler-for-dataloader": "megart's loader runs in the training process "
    "(no workers to signal); " + _LEAVE,
    "--exit-signal-handler-for-training": "megart's --exit-signal-handler covers training; "
    "use that",
    "--iterations-to-skip": "megart trains every iteration; " + _LEAVE,
    "--freeze-all-layers": "megart trains every layer; " + _LEAVE,
    "--start-eval-at-iter": "megart evaluates every --eval-interval iterations; " + _LEAVE,
    "--skip-train": "megart train always trains; " + _LEAVE,
    "--test-mode": "megart has no test mode; " + _LEAVE,
    "--multiple-validation-sets": "megart has one validation set; " + _LEAVE,
    "--validation-set-names": "megart has one validation set; " + _LEAVE,
    "--phase-transition-iterations": "megart has no training phases; " + _LEAVE,
    # Data and logging.
    "--data-args-path": "megart takes --data-path (or --train/valid/test-data-path) on the "
    "command line; give them there",
    "--per-split-data-args-path": "megart takes --train/valid/test-data-path on the command "
    "line; give them there",
    "--per-dataset-sequences-path": "megart reads sequence counts from each .idx file; " + _LEAVE,
    "--dataloader-fast-cache-load": "megart's index cache (--data-cache-path) has one way "
    "of loading; " + _LEAVE,
    "--dataloader-defer-npy-index-mmap": "megart's index cache (--data-cache-path) has one way "
    "of loading; " + _LEAVE,
    "--num-dataset-builder-threads": "megart builds datasets in one thread; " + _LEAVE,
    "--object-storage-cache-path": "megart reads local files only; " + _LEAVE,
    "--mid-level-dataset-surplus": "megart's blends have no such surplus; " + _LEAVE,
    "--padded-vocab-size": "megart pads the vocabulary with --make-vocab-size-divisible-by; "
    "use that",
    "--no-pad-vocab-size": "megart pads the vocabulary with --make-vocab-size-divisible-by "
    "(give 1 for none); use that",
    "--disable-pad-vocab-size": "megart pads the vocabulary with "
    "--make-vocab-size-divisible-by (give 1 for none); use that",
    "--log-progress": "megart has no progress.txt; " + _LEAVE,
    "--tensorboard-queue-size": "megart's TensorBoard writer has no such option; " + _LEAVE,
    "--no-log-loss-scale-to-tensorboard": "megart has no switch for the loss-scale scalar; "
    + _LEAVE,
    "--disable-log-loss-scale-to-tensorboard": "megart has no switch for the loss-scale "
    "scalar; " + _LEAVE,
    "--log-memory-interval": "megart logs memory with --log-memory-to-tensorboard; use that",
    "--log-device-memory-used": "megart logs memory with --log-memory-to-tensorboard; use that",
    "--no-barrier-with-level-1-timing": "megart's timers have no such option; " + _LEAVE,
    "--logging-level": "megart has no logging-level switch; " + _LEAVE,
    "--log-energy": "megart does not measure energy; " + _LEAVE,
    "--yaml-cfg": "megart takes its flags on the command line; give them there",
    # Distributed optimizer and its neighbours.
    "--use-torch-fsdp2": "megart shards optimizer state with --use-distributed-optimizer "
    "(ZeRO-1), not FSDP; use that",
    "--num-distributed-optimizer-instances": "megart has one distributed-optimizer instance; "
    + _LEAVE,
    "--use-precision-aware-optimizer": _OPT,
    "--optimizer-cpu-offload": "megart keeps the optimizer state on the GPU; " + _LEAVE,
}


def refusal(flag: str) -> str | None:
    """Why megart refuses Megatron-LM's ``flag`` (the message, naming it), or None for a flag
    that is not Megatron's or that megart takes."""
    if flag in REFUSED:
        return f"{flag}: {REFUSED[flag]}"
    for reason, names in FAMILIES:
        if any(flag.startswith(n) if n.endswith("-") else flag == n for n in names.split()):
            return f"{flag}: {reason}"
    return None
