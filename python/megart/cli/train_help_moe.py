"""What megart train's mixture-of-experts flags do, as --help shows them (merged into
megart.cli.train_help.HELP)."""

MOE_HELP = {
    "num_experts": "mixture of experts: this many MLPs in each MoE layer, each token routed to "
    "--moe-router-topk of them (needs --disable-bias-linear; --sequence-parallel under tensor "
    "parallelism)",
    "moe_ffn_hidden_size": "each expert's MLP width (default: --ffn-hidden-size)",
    "moe_layer_freq": "which layers are MoE: N (every N-th from the first) or a list "
    'expression of 0/1 per layer, e.g. "([0]+[1]*3)*2" (default: every layer)',
    "moe_router_topk": "experts each token goes to",
    "moe_router_pre_softmax": "softmax over all experts before the top-k (default: the "
    "softmax of the top-k logits); needed with --moe-router-topk 1",
    "moe_router_score_function": "the router's scores: softmax, or sigmoid normalised over "
    "the chosen experts",
    "moe_router_topk_scaling_factor": "the routing weights times this",
    "moe_router_dtype": "the router's logits in fp32 or fp64 (default: the input's dtype)",
    "moe_router_load_balancing_type": "aux_loss (the Switch Transformer's load-balancing loss "
    "over each microbatch), seq_aux_loss (DeepSeek's, over each sequence), global_aux_loss "
    "(over the global batch: every data-parallel rank's and microbatch's counts) or none; "
    "Megatron's sinkhorn is refused",
    "moe_aux_loss_coeff": "the load-balancing loss's weight (Megatron suggests 1e-2)",
    "moe_z_loss_coeff": "the router z-loss's weight (default: none)",
    "moe_router_enable_expert_bias": "aux-loss-free load balancing (DeepSeek-V3's): a "
    "per-expert bias added to the sigmoid scores to choose the top k, updated every iteration "
    "from the tokens each expert got; needs --moe-router-score-function sigmoid",
    "moe_router_bias_update_rate": "how far the expert bias moves each iteration",
    "moe_router_num_groups": "group-limited routing: the experts in this many groups (with "
    "--moe-router-group-topk)",
    "moe_router_group_topk": "group-limited routing: each token's experts from this many of "
    "the --moe-router-num-groups groups, those whose top k/g scores sum highest",
    "moe_shared_expert_intermediate_size": "shared experts: an MLP this wide in each MoE layer "
    "that every token goes through, added to the routed experts' sum",
    "moe_shared_expert_gate": "the shared experts' output times a learned sigmoid gate, "
    "sigmoid(x . w) with w one [1, hidden] weight per layer (Megatron-Core's SharedExpertMLP "
    "gate; Qwen2-MoE's shared_expert_gate)",
    "moe_token_dispatcher_type": "how Megatron-Core moves tokens to their experts: allgather "
    "or alltoall, the same outputs and gradients; megart's layer computes that either way "
    "(gathering the sequence under tensor parallelism, exchanging tokens all-to-all under "
    "expert parallelism); flex (DeepEP's kernels) is refused",
    "moe_grouped_gemm": "runs each layer's (local) experts as one grouped matrix product per "
    "projection over their tokens sorted by expert (torch._grouped_mm), as Megatron-Core's "
    "GroupedMLP, in place of one product per expert: the same outputs, gradients and "
    "checkpoints (the experts keep their per-expert weights); refused with --ckpt-format torch "
    "or torch_dist (Megatron's grouped-expert files)",
    "moe_permute_fusion": "accepted: Transformer Engine's fused sorting of tokens by expert, the "
    "same math; megart sorts them with plain torch ops",
    "moe_router_fusion": "accepted: Transformer Engine's fused top-k and auxiliary-loss "
    "statistics, the same math; megart's router is plain torch",
    "moe_expert_capacity_factor": "token dropping: each expert takes at most ceil(tokens x "
    "topk / experts x this) of the tokens each rank's router routes (a microbatch's, or its "
    "slice under sequence or context parallelism), the rest of its tokens dropped (the residual "
    "carries them); default none, negative: none",
    "moe_token_drop_policy": "which tokens an expert over its capacity drops: probs (the lowest "
    "routing weights) or position (the latest)",
    "moe_pad_expert_input_to_capacity": "each expert's input padded to its capacity with tokens "
    "at weight 0 (needs --moe-expert-capacity-factor)",
    "moe_use_upcycling": "start from --load's dense checkpoint (weights only): each expert its "
    "MLP (or a slice of it), the router fresh; saved to --save (needed, empty) as iteration 1, "
    "training on from there; as Megatron-LM",
    "moe_upcycling_granularity": "with --moe-use-upcycling: the dense MLP is this many times "
    "the experts' width (--ffn-hidden-size x it), each expert one slice of it",
    "moe_input_jitter_eps": "the router's input times uniform noise in [1-eps, 1+eps] in "
    "training (the Switch Transformer's jitter; none in evaluation), each token's noise keyed "
    "by the seed, layer, iteration and sample: the same under every layout",
    "moe_router_force_load_balancing": "benchmarking only: the router's logits replaced by "
    "random normal ones (training and evaluation; gradients passed straight through), so that "
    "routing is balanced by chance; this changes the model's math (Megatron's option)",
    "moe_per_layer_logging": "each layer's auxiliary losses logged too, as "
    "moe/load_balancing_loss_layer_N (Megatron-Core's names; N the 0-based layer, dense "
    "layers 0) to --tensorboard-dir and --log-jsonl",
}
