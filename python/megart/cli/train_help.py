"""What each flag of megart train does, as --help shows it (megart.cli.train builds the
parser: one flag per TrainConfig field, Megatron-LM's name); a test keeps it in step with
TrainConfig's fields."""

from megart.cli.train_help_mla import MLA_HELP
from megart.cli.train_help_moe import MOE_HELP
from megart.cli.train_help_mtp import MTP_HELP
from megart.cli.train_help_yarn import YARN_HELP

HELP = {
    "num_layers": "transformer layers",
    "hidden_size": "hidden size h",
    "num_attention_heads": "attention heads (must divide the hidden size)",
    "seq_length": "tokens per sample",
    "vocab_size": "vocabulary size (256 for the built-in byte corpus; a tokenizer's otherwise)",
    "make_vocab_size_divisible_by": "pad the vocabulary to a multiple of this times the "
    "tensor-parallel size (Megatron's padding; padded entries never enter the loss)",
    "data_path": "PREFIX of a Megatron indexed dataset (PREFIX.bin/.idx), or a blend of several: "
    "W1 PREFIX1 W2 PREFIX2 ... (samples drawn with those weights) or PREFIX1 PREFIX2 ... "
    "(weighted by size); default: the built-in corpus (the Python standard library's sources "
    "as bytes)",
    "train_data_path": "the training dataset, in --data-path's forms (a PREFIX or a blend), "
    "read whole: Megatron-LM's separate dataset per split, instead of --data-path and --split",
    "valid_data_path": "the validation dataset, in --data-path's forms, read whole (with "
    "--train-data-path; unset: no validation)",
    "test_data_path": "the test dataset, in --data-path's forms, read whole (with "
    "--train-data-path; unset: no test)",
    "micro_batch_size": "samples per microbatch",
    "global_batch_size": "samples per iteration, over all data-parallel ranks",
    "rampup_batch_size": "START INCREMENT SAMPLES: Megatron's batch-size ramp-up: the global "
    "batch grows from START by INCREMENT to --global-batch-size over SAMPLES consumed samples "
    "(START and INCREMENT multiples of --micro-batch-size x data-parallel size)",
    "train_iters": "iterations to train",
    "lr": "peak learning rate (Megatron-LM has none: a script gives it; this is the default run's)",
    "min_lr": "learning rate at the end of the decay (the floor of inverse-square-root)",
    "lr_warmup_iters": "iterations of linear warm-up",
    "lr_warmup_init": "the rate warm-up starts from (the first iteration's)",
    "lr_warmup_fraction": "warm up for this fraction of the decay iterations instead (not "
    "with a non-zero --lr-warmup-iters)",
    "lr_decay_iters": "iterations of decay (default: --train-iters)",
    "lr_decay_style": "learning-rate decay after warm-up, Megatron's formulas (WSD: --lr "
    "until the anneal, its last --lr-wsd-decay-iters)",
    "lr_wsd_decay_iters": "with --lr-decay-style WSD: the iterations of the anneal, the last "
    "ones of the decay",
    "lr_wsd_decay_style": "with --lr-decay-style WSD: the anneal's shape, from --lr to --min-lr",
    "weight_decay": "AdamW weight decay (not on biases and norms)",
    "start_weight_decay": "with --weight-decay-incr-style linear or cosine: the weight decay "
    "the run starts with",
    "end_weight_decay": "with --weight-decay-incr-style linear or cosine: the weight decay "
    "the run ends with",
    "weight_decay_incr_style": "how the weight decay rises from --start-weight-decay to "
    "--end-weight-decay over the run (constant: --weight-decay throughout), Megatron's formulas",
    "adam_beta1": "AdamW beta1",
    "adam_beta2": "AdamW beta2",
    "adam_eps": "AdamW epsilon",
    "optimizer": "adam only: Megatron's Adam with decoupled weight decay (AdamW), megart's",
    "clip_grad": "clip gradients to this global norm (0: no clipping)",
    "seed": "random seed: the same seed gives the same loss curve under every layout",
    "hidden_dropout": "dropout probability on hidden states (0 to 1)",
    "attention_dropout": "dropout probability on attention probabilities (0 to 1)",
    "ffn_hidden_size": "MLP hidden size (default: 4 x --hidden-size; with --swiglu Megatron's "
    "int(8h/3 / 64) * 64)",
    "init_method_std": "standard deviation of the initial weights (output projections: "
    "divided by sqrt(2 x layers))",
    "init_method_xavier_uniform": "draw every weight (the embeddings and output projections "
    "too) from Glorot's uniform, U(-a, a) with a = sqrt(6 / (fan_in + fan_out)) of the whole "
    "tensor (Megatron-Core's fused qkv and fc1 shapes; the same for every tensor-parallel "
    "size), instead of a normal of --init-method-std",
    "layernorm_epsilon": "epsilon of LayerNorm and RMSNorm (also --norm-epsilon, Megatron's "
    "newer name)",
    "normalization": "LayerNorm or RMSNorm",
    "qk_layernorm": "normalise each query and key head over its channels before rope (the "
    "model's norm; Megatron-LM's q_layernorm and k_layernorm)",
    "apply_layernorm_1p": "store every norm's weight zero-centred: initialised to 0, the norm "
    "scales by 1 + weight (LayerNorm and RMSNorm; Megatron's layernorm_zero_centered_gamma)",
    "position_embedding_type": "learned_absolute (GPT-2's), rope (rotary, base 10000) or yarn "
    "(rope with YaRN's frequencies and scale: --rotary-scaling-factor, --yarn-*, --mscale*)",
    "swiglu": "SwiGLU MLP (three matrices) instead of GeLU",
    "squared_relu": "squared ReLU, relu(x)^2, as the MLP's activation instead of GeLU (Nemotron's)",
    "quick_geglu": "gated MLP of quick GeLU, x * sigmoid(1.702 x), on its gate half (gpt-oss's)",
    "glu_linear_offset": "with --quick-geglu: add this to the linear half (gpt-oss's 1.0)",
    "activation_func_clamp_value": "with --quick-geglu: clamp the gate half at most to this and "
    "the linear half within plus or minus it (gpt-oss's 7.0)",
    "disable_bias_linear": "no biases in the linear layers; LayerNorm keeps its bias (as "
    "Megatron-Core's add_bias_linear=False)",
    "add_qkv_bias": "keep the attention's fused q/k/v projection's bias under "
    "--disable-bias-linear (Qwen2's attention; with biases on it changes nothing)",
    "untie_embeddings_and_output_weights": "give the output layer its own weight instead of the "
    "input embedding's (Llama-style; GPT-2 ties them)",
    "group_query_attention": "grouped-query attention: query heads share key/value heads in "
    "--num-query-groups groups",
    "window_size": "LEFT,RIGHT: sliding-window attention (Megatron's, Mistral's): each token "
    "attends to itself and the LEFT tokens before it (-1: all of them); RIGHT must be 0 (the "
    "attention is causal). Hugging Face's sliding_window W is LEFT = W - 1. Under context "
    "parallelism by global positions, with every --cp-comm-type",
    "window_attn_skip_freq": "with --window-size, the layers without the window: N (every "
    "N-th layer, counting from 1) or a list of 0 (whole sequence) or 1 (window) per layer, "
    'e.g. "([1]*3+[0])*2"',
    "num_query_groups": "key/value heads (query groups) with --group-query-attention; must "
    "divide --num-attention-heads and be divisible by the tensor-parallel size (1: multi-query "
    "attention)",
    "tensor_model_parallel_size": "tensor-parallel size t",
    "pipeline_model_parallel_size": "pipeline-parallel size p",
    "num_layers_per_virtual_pipeline_stage": "layers per model chunk: the interleaved 1F1B "
    "schedule (default: one chunk per rank, 1F1B)",
    "num_virtual_stages_per_pipeline_rank": "model chunks per pipeline rank: the interleaved "
    "1F1B schedule, as --num-layers-per-virtual-pipeline-stage but by count (Megatron-LM's "
    "way with uneven stages)",
    "decoder_first_pipeline_num_layers": "the number of transformer layers on the first "
    "pipeline stage of the decoder (default: an even split of the layers over all stages)",
    "decoder_last_pipeline_num_layers": "the number of transformer layers on the last pipeline "
    "stage of the decoder (default: an even split of the layers over all stages)",
    "pipeline_schedule": "1f1b, interleaved (needs --num-layers-per-virtual-pipeline-stage), "
    "zb-h1 (zero bubble: backward split into input and weight gradients, 1F1B's memory) or "
    "zb-v (zero bubble, two chunks per rank in a V; needs 2p microbatches) (default: 1f1b, or "
    "interleaved with --num-layers-per-virtual-pipeline-stage)",
    "sequence_parallel": "split LayerNorm and dropout activations over the sequence across "
    "tensor-parallel ranks",
    "scatter_gather_tensors_in_pipeline": "send whole activations between stages (no 1/t "
    "slices)",  # its flag is --no-... (see below)
    "use_distributed_optimizer": "shard the optimizer state over data-parallel ranks (ZeRO-1): "
    "reduce-scatter the gradients, step 1/dp of the parameters, all-gather them (the experts' "
    "over their dp x cp/EP expert-data-parallel ranks under --expert-model-parallel-size EP)",
    "distributed_backend": "communication: megart's nccl transport (default with a GPU), its "
    "shm transport (default on CPU), or torch: torch.distributed's groups (NCCL on GPU, gloo on "
    "CPU), the fallback when `megart selftest` fails a megart transport",
    "bf16": "bf16 compute under autocast, fp32 weights; the residual stream and pipeline "
    "messages in bf16 (as Megatron-LM's)",
    "fp16": "fp16 compute under autocast with loss scaling, fp32 weights; the residual stream "
    "and pipeline messages in fp16 (as Megatron-LM's)",
    "fp32_residual_connection": "with --bf16/--fp16: keep the residual stream, and so the "
    "pipeline messages, in fp32",
    "half_weights": "with --bf16/--fp16: keep the weights in that 16-bit type, with fp32 main "
    "weights and gradients in the optimizer, as Megatron-LM does (2 + 4 + 4 bytes a parameter "
    "besides Adam's 8, the main weights sharded with --use-distributed-optimizer; default: fp32 "
    "weights under autocast)",
    "loss_scale": "a static fp16 loss scale (default: dynamic)",
    "initial_loss_scale": "the dynamic fp16 loss scale's start",
    "min_loss_scale": "the dynamic fp16 loss scale's floor",
    "loss_scale_window": "overflow-free iterations before the dynamic loss scale doubles",
    "hysteresis": "the dynamic fp16 loss scale halves at the N-th overflow since it last grew "
    "and at each one after it (every overflow skips its step; 1: halve at every overflow)",
    "bias_gelu_fusion": "megart's fused bias+GeLU CUDA kernel (torch's ops on a CPU); on by "
    "default, as in Megatron-LM, wherever the MLP has a bias and GeLU (not with --swiglu or "
    "--disable-bias-linear); --no-bias-gelu-fusion turns it off",
    "fused_layer_norm": "megart's fused LayerNorm(+residual) CUDA kernel",
    "gradient_accumulation_fusion": "compute linear layers' weight gradients in the compute "
    "dtype, then cast and add them into the fp32 gradients (by default the product adds them "
    "itself, accumulating in fp32, as Megatron-LM's fusion does)",
    "cross_entropy_loss_fusion": "megart's in-place vocab-parallel cross-entropy CUDA kernel",
    "recompute_activations": "shorthand for --recompute-granularity selective (recomputing "
    "--recompute-modules, by default the attention core)",
    "recompute_granularity": "full (whole layers) or selective (the --recompute-modules) "
    "recomputation (default: none)",
    "recompute_modules": "what selective recomputation recomputes, one or more of core_attn "
    "(the attention core), layernorm (the input and pre-MLP norms' outputs, freed and made "
    "again in backward) and mlp (the whole MLP, from its input); Megatron's other modules "
    "(moe, moe_act, shared_experts, mla_up_proj...) are refused; only with "
    "--recompute-granularity selective or --recompute-activations (default: core_attn)",
    "recompute_method": "uniform or block: which layers full recomputation covers",
    "recompute_num_layers": "layers per recomputed group (uniform) or recomputed layers (block)",
    "log_interval": "iterations between progress lines",
    "eval_interval": "iterations between validation-loss evaluations (and one after the last)",
    "eval_iters": "global batches per evaluation (0: no evaluation)",
    "eval_global_batch_size": "samples of each evaluation batch (default: --global-batch-size)",
    "eval_micro_batch_size": "samples of each evaluation microbatch (default: --micro-batch-size)",
    "split": "train,validation,test weights over the corpus, e.g. 90,5,5 (unset: 969,30,1, "
    "Megatron-LM's legacy default; not with the per-split paths)",
    "log_jsonl": "write one JSON object per iteration to this file",
    "tensorboard_dir": "write TensorBoard scalars here (needs the tensorboard package)",
    "log_memory_to_tensorboard": "also write the GPU memory scalars (Megatron-LM's "
    "mem-allocated-bytes, mem-max-allocated-bytes, mem-reserved-bytes, mem-allocated-count, and "
    "megart's mem-static-bytes) under --tensorboard-dir; nothing on CPU",
    "tensorboard_log_interval": "iterations between TensorBoard scalars",
    "log_params_norm": "log the L2 norm of the weights after each step (the fp32 main weights "
    "the optimizer steps; Megatron-LM's params norm / params-norm)",
    "log_num_zeros_in_grad": "log how many gradient elements each step read as zero "
    "(Megatron-LM's num zeros / num-zeros; none on a skipped fp16 step)",
    "timing_log_level": "Megatron-LM's per-phase timers, reported every --log-interval "
    "iterations: 0 none, 1 the iteration's phases (forward-backward, gradient syncs, the "
    "optimizer's parts), 2 also the batch generator (on a GPU each phase is timed between "
    "device synchronisations)",
    "timing_log_option": "how the timers are reported across ranks: max, minmax or all",
    "log_timers_to_tensorboard": "also write the timers (each phase's max across ranks) under "
    "--tensorboard-dir as <name>-time",
    "log_world_size_to_tensorboard": "also write the number of processes (world-size) under "
    "--tensorboard-dir",
    "log_validation_ppl_to_tensorboard": "accepted: megart writes the validation and test "
    "perplexities (lm loss validation ppl, ...) always",
    "save": "directory to write checkpoints to (Megatron's layout)",
    "save_interval": "iterations between checkpoints (one is also written after the last; "
    "unset: only that one)",
    "load": "directory to resume from (its latest checkpoint, megart's or Megatron-LM's legacy "
    "one; one saved under another tensor-, pipeline- or expert-parallel layout is resharded; "
    "with "
    "--non-persistent-ckpt-type global, the non-persistent one where it is newer)",
    "no_save_optim": "save checkpoints without the optimizer state (nor the fp16 loss scale); "
    "resuming from one needs --no-load-optim or --finetune",
    "no_save_rng": "save checkpoints without the random streams; resuming from one needs "
    "--no-load-rng or --finetune",
    "save_retain_interval": "keep the checkpoints of iterations that are multiples of N and the "
    "latest one; delete each other one once the next is complete (Megatron-LM's rule; a multiple "
    "of --save-interval)",
    "non_persistent_save_interval": "also save every N iterations (where no --save-interval "
    "checkpoint is due) a checkpoint that is not kept: each deletes the older ones but the "
    "newest; --load resumes from the newest of both kinds (Megatron-LM's; needs "
    "--non-persistent-ckpt-type global and --ckpt-format megart or torch_dist)",
    "non_persistent_ckpt_type": "global: non-persistent checkpoints are whole checkpoints in "
    "--non-persistent-global-ckpt-dir, which --load also reads (local and in_memory, Megatron's "
    "per-rank kinds, are refused)",
    "non_persistent_global_ckpt_dir": "where non-persistent checkpoints are saved and loaded "
    "(default: <save>/non_persistent, and <load>/non_persistent for --load)",
    "async_save": "write --ckpt-format torch_dist checkpoints in a background thread from a "
    "copy of the state taken at the save; each is completed (its tracker written) before the "
    "next save and at the end of training (Megatron-LM's --async-save)",
    "ckpt_step": "load --load's checkpoint of iteration N (iter_000000N) instead of its latest",
    "exit_on_missing_checkpoint": "stop with an error when --load holds no checkpoint, instead "
    "of starting from scratch",
    "override_opt_param_scheduler": "resume a Megatron-LM checkpoint (--ckpt-format torch or "
    "torch_dist) whose saved learning-rate schedule differs from these flags, following the "
    "flags (Megatron-LM's --override-opt_param-scheduler; without it a difference is refused)",
    "use_checkpoint_opt_param_scheduler": "resume on the learning-rate schedule saved in a "
    "Megatron-LM checkpoint (--ckpt-format torch or torch_dist) instead of these flags' "
    "(Megatron-LM's --use-checkpoint-opt_param-scheduler; the flags set to it are printed)",
    "no_load_optim": "do not load the optimizer state (nor the fp16 loss scale) from --load",
    "no_load_rng": "do not load the random streams from --load (start them from --seed)",
    "finetune": "load only the model weights from --load and start at iteration 0 (fresh "
    "optimizer and random streams)",
    "pretrained_checkpoint": "DIR: where --load holds no checkpoint yet (or is not given), "
    "start from this checkpoint's weights at iteration 0, as --finetune (Megatron-LM's "
    "fine-tuning start)",
    "exit_interval": "stop after every N-th iteration (saving first when --save is given)",
    "exit_duration_in_mins": "stop once the run has trained this many minutes (saving first)",
    "exit_signal_handler": "on SIGTERM finish the iteration, save (with --save) and stop",
    "max_position_embeddings": "rows of the learned position table (megart's: exactly "
    "--seq-length; with rope at least that)",
    "kv_channels": "each attention head's width (default --hidden-size / "
    "--num-attention-heads; Qwen3's head_dim)",
    "rotary_base": "rope's base",
    "rotary_interleaved": "rope rotates adjacent pairs (x[2i], x[2i+1]) instead of the halves "
    "(x[i], x[i + d/2]), Megatron's default; megart before this flag rotated adjacent pairs",
    "use_rope_scaling": "scale rope's frequencies as Llama 3.x does (Hugging Face's rope type "
    "llama3): those turning less than once over 8192 positions divided by "
    "--rope-scaling-factor, those turning over 4 times kept, a smooth blend between",
    "rope_scaling_factor": "with --use-rope-scaling: what the slow frequencies are divided by "
    "(at least 1)",
    "rotary_seq_len_interpolation_factor": "position interpolation: rope turns position p as "
    "it would p / F (Hugging Face's rope type linear), to fit a context F times longer into "
    "the angles trained; any positive number (Megatron-LM takes integers)",
    "attention_backend": "auto, flash, fused (torch's sdpa picks the kernel), unfused or local "
    "(its math kernel)",
    "softmax_type": "vanilla, or an attention sink in every softmax row (gpt-oss's): off-by-one "
    "adds a logit 0, learnable a learned logit per head (no weight decay)",
    "use_flash_attn": "Megatron's older switch for its flash-attention kernel: --attention-backend "
    "flash",
    "transformer_impl": "accepted: megart's own layers compute Megatron-Core's GPT either way "
    "(no Transformer Engine)",
    "tokenizer_type": "the tokenizer whose vocabulary the model has (GPT2BPETokenizer is implied "
    "by --vocab-file and --merge-file; NullTokenizer has --vocab-size + 1 ids)",
    "vocab_file": "GPT-2 vocabulary (gpt2-vocab.json) for GPT2BPETokenizer",
    "merge_file": "GPT-2 merges (gpt2-merges.txt) for GPT2BPETokenizer",
    "tokenizer_model": "Hugging Face tokenizer (directory or name) for HuggingFaceTokenizer",
    "mock_data": "train on random tokens of the vocabulary (seeded) instead of a corpus",
    "num_workers": "data loader workers: accepted; megart reads memory-mapped samples in the "
    "training process",
    "data_order": "megart (default): megart's sample order; megatron: Megatron-Core's "
    "GPTDataset/BlendedDataset samples in Megatron-LM's order and data-parallel slices, so "
    "batches equal Megatron-LM's for the same --data-path (or per-split paths), --split, "
    "--seed, --seq-length and batch flags (indexed datasets only; no --train-samples or "
    "--rampup-batch-size)",
    "allow_ambiguous_pad_tokens": "with --data-order megatron and a Hugging Face tokenizer "
    "whose pad id is its end-of-document id: mask that id's labels and map it to 0 as a pad "
    "(Megatron-Core's GPTDataset otherwise masks nothing; a distinct pad id is always masked)",
    "full_validation": "Megatron-LM's whole-validation-set evaluation: refused (its meaning "
    "differs between Megatron-LM versions; give --eval-iters)",
    "mmap_bin_files": "read the .bin files into memory instead of memory-mapping them",
    "create_attention_mask_in_dataloader": "no attention mask from the data loader (megart "
    "never builds one there: the same model either way; not with --reset-attention-mask, which "
    "Megatron-LM then does not apply)",
    "train_samples": "samples to train: --train-iters = this // --global-batch-size",
    "lr_decay_samples": "samples of decay (default: --train-samples)",
    "lr_wsd_decay_samples": "with --lr-decay-style WSD: the samples of the anneal",
    "lr_warmup_samples": "samples of linear warm-up",
    "overlap_grad_reduce": "reduce every gradient bucket after backward instead of while it "
    "runs",  # its flag is --no-...; --overlap-grad-reduce (megart's default) is accepted too
    "ddp_bucket_size": "gradient bucket size in elements (Megatron's; default: megart's 4 MiB "
    "buckets, and in Megatron-format files Megatron's max(4e7, 1e6 x data-parallel size))",
    "ddp_num_buckets": "gradient buckets per rank: the bucket size is this rank's parameters "
    "divided by N, rounded down, as Megatron-LM computes it (not with --ddp-bucket-size)",
    "overlap_param_gather": "with --use-distributed-optimizer: each bucket's parameter "
    "all-gather finishes just before the next forward first uses it",
    "decoupled_lr": "the word embedding's and output layer's own peak learning rate (their "
    "own param group, on --lr's schedule)",
    "decoupled_min_lr": "their floor with --decoupled-lr (default: --min-lr)",
    "grad_reduce_in_bf16": "with --bf16: average the gradients over data parallelism in bf16 "
    "(half the bytes; megart still accumulates microbatches in fp32)",
    "accumulate_allreduce_grads_in_fp32": "accepted: megart accumulates and averages the "
    "gradients in fp32 with or without it (Megatron's --fp16 default is fp16); recorded in "
    "--ckpt-format torch files, whose gradient buffer it makes fp32",
    "log_throughput": "accepted: megart's progress line always has TFLOP/s per GPU "
    "(Megatron's count)",
    "ckpt_format": "megart (megart's checkpoint); torch (Megatron-LM's legacy layout: model, "
    "optimizer, scheduler, random states per rank; distrib_optim.pt with "
    "--use-distributed-optimizer); torch_dist (Megatron-LM's distributed format, the whole "
    "training state, each rank writing its slices; with --use-distributed-optimizer its "
    "dp_reshardable buckets, not under zb-v). "
    "--load reads any of them whatever this flag",
    "calculate_per_token_loss": "with --eod-mask-loss: the gradient of the global batch's loss "
    "sum over its unmasked tokens' count, instead of the mean of each microbatch's mean over "
    "its own (without the mask the two are the same)",
    "eod_mask_loss": "no loss for the prediction made from an end-of-document token (the "
    "tokenizer's: <|endoftext|>, eos, NullTokenizer's extra id): each microbatch's loss is the "
    "mean over its other tokens, as Megatron-LM's; the loss reported is the global batch's "
    "mean over those tokens",
    "reset_position_ids": "positions restart at 0 after each end-of-document token (learned "
    "positions and rope)",
    "reset_attention_mask": "tokens after an end-of-document token attend only to their own "
    "document (block-diagonal causal mask; on CUDA an explicit mask, so no flash kernel). Not "
    "with --context-parallel-size above 1",
    "context_parallel_size": "context parallelism: each sequence split over this many ranks "
    "(Megatron's load-balanced 2 cp chunks; --seq-length divisible by 2 cp), keys and values "
    "passed around a ring of them (--cp-comm-type p2p, the default, as in Megatron), "
    "all-gathered over them (all_gather) or exchanged for heads (a2a); ranks tp x cp x dp x "
    "pp, cp between tp and dp. With --sequence-parallel each rank's s/cp tokens split over tp "
    "(s/cp divisible by tp)",
    "cp_comm_type": "how keys and values travel between context-parallel ranks: p2p "
    "(Megatron's default), a ring: each rank keeps its queries and its own K/V, passes K/V "
    "blocks to the next rank cp - 1 times and folds the partial attentions by log-sum-exp; the "
    "backward recomputes each block and sends dK/dV back to their owner (a rank holds at most "
    "the visiting K/V block and the arriving one); its blocks are flash kernels on a GPU in "
    "fp16/bf16 and on the CPU without dropout, explicit fp32 products otherwise (with "
    "--window-size each block's pieces inside the window by kernels given a bias: on a GPU "
    "the memory-efficient kernel in fp16/bf16/fp32, on the CPU without dropout). all_gather: "
    "every rank gathers the whole sequence's K/V. a2a "
    "(DeepSpeed Ulysses): all-to-all exchanges give each rank 1/cp of the heads for the whole "
    "sequence (heads and query groups per tensor-parallel rank divisible by cp). The same "
    "attention every way. a2a+p2p (hierarchical) is refused",
    "expert_model_parallel_size": "expert parallelism: each MoE layer's experts spread over "
    "this many data- and context-parallel ranks (each expert split over the tensor-parallel "
    "ranks as the MLP is, Megatron's default --expert-tensor-parallel-size)",
    "use_mcore_models": "accepted (deprecated in Megatron-LM, whose only GPT is Megatron-Core's "
    "GPTModel: megart's model and checkpoint names are that model's)",
    "rotary_percent": "the part of each head rope rotates: its first int(head size x this) "
    "channels (an even number), the rest unrotated (partial rotary); 1.0 rotates the whole head",
    "data_cache_path": "with --data-order megatron: where rank 0 writes the datasets' indices "
    "once (Megatron-Core's document, sample, shuffle and blending arrays, as .npy files named by "
    "a hash of what they depend on, the data files' size and time included) for every rank to "
    "map read-only, and later runs to reuse; a file system every node sees. Without it each "
    "rank builds them in memory. Accepted and unused with megart's own order, which builds no "
    "index",
    "tiktoken_pattern": "TikTokenizer's pattern (v1 or v2): accepted; megart takes no "
    "TikTokenizer, so it changes nothing",
    "manual_gc": "turn Python's automatic garbage collector off for the run and collect at "
    "chosen points instead (the same points on every rank)",
    "manual_gc_interval": "with --manual-gc: collect every N iterations (0: never between "
    "iterations)",
    "manual_gc_eval": "with --manual-gc: no collection before and after each evaluation",
    "empty_unused_memory_level": "return cached CUDA memory: 1 after each forward and "
    "backward (and evaluation batch), 2 also after each optimizer step (nothing to return on "
    "CPU)",
    "profile": "profile iterations --profile-step-start to --profile-step-end: with "
    "--use-pytorch-profiler torch's profiler, else a CUDA profiler range for nsys "
    "(--capture-range=cudaProfilerApi; needs a GPU)",
    "profile_step_start": "the iteration count at which profiling starts",
    "profile_step_end": "the iteration count at which profiling stops",
    "use_pytorch_profiler": "with --profile: torch's profiler, its Chrome trace in "
    "--tensorboard-dir/../torch_profile/rank-N.json.gz (as Megatron-LM writes it)",
    "profile_ranks": "global ranks to profile (default: every rank)",
    "pytorch_profiler_collect_shapes": "with --use-pytorch-profiler: record the operators' "
    "input shapes",
    "pytorch_profiler_collect_callstack": "with --use-pytorch-profiler: record the Python "
    "call stacks",
    "check_for_nan_in_loss_and_grad": "do not stop the run when the loss or gradient norm is "
    "not finite",  # its flag is --no-... (see below)
    "distributed_timeout_minutes": "every wait on another rank (rendezvous, group creation, "
    "communication) gives up after this long, naming the rank it waited on",
    **MOE_HELP,
    **MLA_HELP,
    **YARN_HELP,
    **MTP_HELP,
}
