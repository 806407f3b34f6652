"""What megart train's YaRN flags do, as --help shows them (merged into
megart.cli.train_help.HELP)."""

YARN_HELP = {
    "rotary_scaling_factor": "with --position-embedding-type yarn (or multi-latent "
    "attention's --rope-type yarn): how many times longer a "
    "context YaRN extends to; the slow frequencies are divided by it (at least 1)",
    "yarn_original_max_position_embeddings": "with yarn: the context the model was trained "
    "with before the extension (default 4096)",
    "yarn_beta_fast": "with yarn: pairs turning more than this many times over the original "
    "context keep their frequency (default 32)",
    "yarn_beta_slow": "with yarn: pairs turning fewer than this many times over it are divided "
    "by the factor, those between blended (default 1)",
    "mscale": "with yarn: cos and sin are times (0.1 mscale ln(factor) + 1) / (0.1 "
    "mscale_all_dim ln(factor) + 1), so the attention logits by its square",
    "mscale_all_dim": "with yarn: the denominator's mscale (see --mscale); multi-latent "
    "attention also scales its scores by (0.1 mscale_all_dim ln(factor) + 1) squared",
    "yarn_correction_range_round_to_int": "with yarn: the blend's first and last pairs "
    "rounded outwards to whole pairs (Hugging Face's truncate)",
}
