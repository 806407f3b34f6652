"""What megart train's multi-latent attention flags do, as --help shows them (merged into
megart.cli.train_help.HELP)."""

MLA_HELP = {
    "multi_latent_attention": "multi-latent attention (DeepSeek-V2/V3's MLA, Megatron-Core's "
    "MLASelfAttention): keys and values from a --kv-lora-rank latent of each token, queries "
    "from h or a --q-lora-rank latent, rope on --qk-pos-emb-head-dim channels of each head "
    "(the key's shared by the heads); needs --position-embedding-type rope; --rope-type "
    "picks its rope; --qk-layernorm adds the latents' norms",
    "q_lora_rank": "MLA: the queries' latent width (default: queries projected from the "
    "hidden state directly)",
    "kv_lora_rank": "MLA: the keys' and values' latent width",
    "qk_head_dim": "MLA: each query and key head's channels without rope",
    "qk_pos_emb_head_dim": "MLA: each query and key head's rope channels (even)",
    "v_head_dim": "MLA: each value head's channels",
    "rope_type": "multi-latent attention's rope: yarn (its default, as Megatron-LM's; with "
    "--rotary-scaling-factor (default 1: plain rope's angles), --mscale, --mscale-all-dim; the "
    "scores scaled by (0.1 mscale_all_dim ln(factor) + 1) squared too) or rope (plain); "
    "other attention takes rope only",
}
