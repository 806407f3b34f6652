"""The families of Megatron-LM's flags that megart refuses with one reason each (a capability
megart lacks: MoE, MLA, FP8, FSDP, inference, RL, other model families...): see
megart.training.megatron_refusals, which refuses them by name.
"""

from __future__ import annotations

# (reason, names): names separated by spaces; one ending in "-" is a prefix of every flag of
# the family.
FAMILIES: tuple[tuple[str, str], ...] = (
    (
        "megart's mixture-of-experts layers (--num-experts) route each token to its top-k "
        "experts (--moe-router-topk, --moe-router-pre-softmax, --moe-router-score-function, "
        "--moe-router-topk-scaling-factor, --moe-router-dtype, group-limited with "
        "--moe-router-num-groups and --moe-router-group-topk, an expert bias with "
        "--moe-router-enable-expert-bias, --moe-input-jitter-eps, "
        "--moe-router-force-load-balancing) with the aux_loss, seq_aux_loss or global_aux_loss "
        "and the z-loss (--moe-per-layer-logging), plus shared experts "
        "(--moe-shared-expert-intermediate-size, "
        "--moe-shared-expert-gate), token dropping (--moe-expert-capacity-factor, "
        "--moe-token-drop-policy, --moe-pad-expert-input-to-capacity), dispatched by "
        "--moe-token-dispatcher-type allgather or alltoall, with --moe-grouped-gemm, "
        "--moe-permute-fusion and --moe-router-fusion taken as the same math; this MoE feature "
        "is not built (leave it out)",
        (
            "--moe- --expert-tensor-parallel- --use-grouped-gemm-for- "
            "--overlap-moe-expert-parallel-comm --overlap-dispatch-backward-with-experts-wgrad "
            "--ep-overlap-early-attn-memory-release --high-priority-a2a-comm-stream "
            "--save-tokens-per-expert-interval"
        ),
    ),
    (
        "megart's multi-latent attention (--multi-latent-attention, --q-lora-rank, "
        "--kv-lora-rank, --qk-head-dim, --qk-pos-emb-head-dim, --v-head-dim) turns plain rope "
        "or YaRN (--rope-type rope|yarn): inference's cached latents (--cache-mla-latents) and "
        "the fused down-projection (--mla-down-proj-fusion) are not built; leave it out",
        "--mla- --cache-mla-latents",
    ),
    (
        "megart's rope has Llama 3's scaling (--use-rope-scaling), position interpolation "
        "(--rotary-seq-len-interpolation-factor) and YaRN (--position-embedding-type yarn), not "
        "multimodal rope; leave it out",
        "--mrope-section",
    ),
    (
        "megart has no attention variants besides softmax attention (no DeepSeek sparse, gated "
        "delta-net, linear or Mamba layers); leave it out",
        (
            "--experimental-attention-variant --dsa- --no-dsa- --disable-dsa- --linear- --mamba- "
            "--disable-mamba- --is-hybrid-model --hybrid- --gdp- --heterogeneous-layers-config- "
            "--spec --enable-experimental"
        ),
    ),
    (
        "megart's multi-token prediction is --mtp-num-layers with --mtp-loss-scaling-factor, "
        "its depths on the last pipeline stage, each with a layer of its own (no repeated "
        "layer, detached heads, hidden-state mixing, standalone stage or hybrid pattern); "
        "leave it out",
        "--mtp-standalone --mtp-use-repeated-layer --mtp-detach-heads --mtp-hsm "
        "--mtp-hybrid-override-pattern",
    ),
    (
        "megart has no hyper-connections (mHC); leave it out",
        "--mhc- --enable-mhc-connections",
    ),
    (
        "megart has no muP parametrisation; give the initialisation and learning rate directly "
        "(--init-method-std, --lr)",
        "--mup- --use-mup",
    ),
    (
        "megart trains in fp32, --bf16 or --fp16 only (no FP8/FP4, Transformer Engine's or "
        "kitchen's); train with --bf16 and leave it out",
        (
            "--fp8- --no-fp8- --disable-fp8- --fp4- --first-last-layers-bf16 "
            "--num-layers-at-start-in-bf16 --num-layers-at-end-in-bf16 --keep-fp8-transpose-cache "
            "--reuse-grad-buf-for-mxfp8-param-ag --te-precision-config-file --kitchen- "
            "--use-kitchen-attention"
        ),
    ),
    (
        "megart overlaps only its column-parallel products' backward collectives with their "
        "weight gradients, always, not every collective with the products (Transformer "
        "Engine's userbuffers); leave it out",
        "--tp-comm- --no-tp-comm- --disable-tp-comm-",
    ),
    (
        "megart does not capture CUDA graphs; leave it out",
        "--cuda-graph- --enable-cuda-graph --external-cuda-graph --optimizer-cuda-graph",
    ),
    (
        "megart train trains; it has no inference engine or text-generation server; leave it out",
        (
            "--inference- --no-inference- --flash-decode --num-speculative-tokens "
            "--enable-chunked-prefill --use-legacy-static-engine --max-tokens-to-oom "
            "--mlp-chunks-for-prefill --nccl-all-reduce-for-prefill --symmetric-ar-type "
            "--decode-only-cuda-graphs --batch-invariant- --use-same-sampling-seed-"
        ),
    ),
    (
        "megart has no reinforcement learning (RL, GRPO) loop; leave it out",
        "--rl- --no-rl- --grpo- --perform-rl-step --langrl-env-config --refit-method",
    ),
    (
        "megart's optimizer is Adam (AdamW) only (--optimizer adam); leave it out",
        "--muon- --lion- --sgd-momentum",
    ),
    (
        "megart's optimizer state stays on the GPU (no CPU offload); leave it out",
        (
            "--optimizer-offload-fraction --use-torch-optimizer-for-cpu-offload "
            "--overlap-cpu-optimizer-d2h-h2d --no-pin-cpu-"
        ),
    ),
    (
        "megart's optimizer is Adam (AdamW) with fp32 moments and main weights on the GPU; "
        "leave it out",
        "--main-grads-dtype --main-params-dtype --exp-avg-dtype --exp-avg-sq-dtype",
    ),
    (
        "megart does not offload activations to the CPU; use --recompute-activations or "
        "--recompute-granularity full to save memory",
        (
            "--offload-modules --fine-grained- --min-offloaded-tensor-size "
            "--delay-offload-until-cuda-graph --delta-offload-bytes-across-pp-ranks "
            "--activation-offload-fraction --cpu-offloading-"
        ),
    ),
    (
        "megart shards optimizer state with --use-distributed-optimizer (ZeRO-1), not FSDP; use "
        "that",
        (
            "--megatron-fsdp- --use-megatron-fsdp --fsdp- --torch-fsdp2- --no-strict-fsdp- "
            "--disable-strict-fsdp- --data-parallel-sharding-strategy --outer-dp-sharding-strategy "
            "--enable-full-sharding-in-hsdp --suggested-communication-unit-size "
            "--create-all-gather-group --no-gradient-reduce-div-fusion --use-nccl-ub "
            "--disable-symmetric-registration --gtp- --tensor-parallel-num-weight-shards "
            "--init-model-with-meta-device --no-use-layer-wise-param-layout"
        ),
    ),
    (
        "megart's data is GPT pretraining samples from --data-path (or --mock-data); it has no "
        "fill-in-the-middle, SFT, distillation or BERT/T5 data; leave it out",
        (
            "--fim- --sft --sft- --logits- --mask-prob --short-seq-prob --vocab-extra-ids "
            "--sample-rate --dataloader-inter-document-masking"
        ),
    ),
    (
        "megart trains GPT (decoder-only) models; it has no BERT, T5, retrieval (ICT, "
        "biencoder) or vision (ViT, DINO) models; leave it out",
        (
            "--bert- --output-bert-embeddings --encoder- --decoder-num-layers --decoder-seq-length "
            "--relative-attention- --ict- --biencoder- --retriever- --titles-data-path "
            "--query-in-block-prob --use-one-sent-docs --evidence-data-path --block-data-path "
            "--embedding-path --indexer- --vision- --swin- --dino- --img- --num-channels "
            "--patch-dim --num-classes --classes-fraction --data-per-class-fraction "
            "--no-data-sharding --head-lr-mult --mask-type --mask-factor --iter-per-epoch"
        ),
    ),
    (
        "megart has no in-process restart, fault-tolerance package, fault injection or rerun "
        "state machine (a failed rank ends the job; resume with --load); leave it out",
        (
            "--inprocess- --enable-ft-package --calc-ft-timeouts --ft- --fault-injector- "
            "--error-injection- --rerun-mode --check-for-spiky-loss --check-for-large-grads "
            "--result-rejected-tracker-filename"
        ),
    ),
    (
        "megart logs to TensorBoard (--tensorboard-dir) and JSON lines (--log-jsonl) only, not "
        "to Weights & Biases, one-logger, OpenTelemetry or a straggler detector; leave it out",
        (
            "--wandb- --one-logger- --no-one-logger --app-tag-run- --otel- --straggler- "
            "--log-straggler --disable-straggler-on-startup --run-workload-inspector-server "
            "--adlr-autoresume --adlr-autoresume- --config-logger-dir --enable-msc"
        ),
    ),
    (
        "megart does not register NCCL's flight recorder or SHARP, nor take NCCL communicator "
        "configs (its communicator is its own); leave it out",
        (
            "--flight-recorder- --no-flight-recorder- --disable-flight-recorder- --use-sharp "
            "--sharp-enabled-group --nccl-communicator-config-path --high-priority-stream-groups "
            "--tp-comm-bootstrap-backend"
        ),
    ),
    (
        "megart has no such checkpoint option; --ckpt-format (megart, torch, torch_dist), "
        "--async-save and --non-persistent-* are what it takes; leave it out",
        (
            "--async-ckpt- --async-strategy --use-persistent-ckpt-worker --ckpt-fully-parallel- "
            "--no-ckpt-fully-parallel-save --ckpt-convert- --dist-ckpt-strictness "
            "--dist-ckpt-save-pre-mcore-014 --dist-ckpt-optim-fully-reshardable "
            "--distrib-optim-fully-reshardable-mem-efficient --dist-ckpt-workers "
            "--ckpt-assume-constant-structure --ckpt-pg-tensors-cache- --no-ckpt-load-validate- "
            "--disable-ckpt-load-validate- --ckpt-drop-redundant-extra-state "
            "--auto-detect-ckpt-format --replication --replication- --non-persistent-local-ckpt- "
            "--persistent-save-interval --verify-integrity --override-ckpt-iteration "
            "--load-main-params-from-ckpt --no-save-tokenizer- --disable-save-tokenizer- "
            "--save-params-interval --save-activations-interval --save-wgrads-interval "
            "--save-dgrads-interval --dump-param-to-param-group-map"
        ),
    ),
    (
        "megart's profiling is --profile (nsys range, or --use-pytorch-profiler); it has no "
        "memory history, chakra or NVTX options; leave it out",
        (
            "--pytorch-profiler-collect-chakra --record-memory-history --memory-snapshot-path "
            "--record-shapes --nvtx-ranges"
        ),
    ),
    (
        "megart's tokenizers are GPT2BPETokenizer, HuggingFaceTokenizer and NullTokenizer with "
        "their default options (--tokenizer-type); leave it out",
        (
            "--tokenizer-metadata --tokenizer-special-tokens --tiktoken-num-special-tokens "
            "--tokenizer-sentencepiece- --no-tokenizer-sentencepiece- "
            "--disable-tokenizer-sentencepiece- --tokenizer-hf- --trust-remote-code "
            "--null-tokenizer- --chat-template --use-gigatoken"
        ),
    ),
)
