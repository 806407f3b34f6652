"""What megart train's multi-token prediction flags do, as --help shows them (merged into
megart.cli.train_help.HELP; the depths are megart.models.mtp's)."""

MTP_HELP = {
    "mtp_num_layers": "multi-token prediction (DeepSeek-V3's, as Megatron-Core's): this many "
    "depths on the last pipeline stage, depth k predicting the token k+1 places ahead from "
    "the previous depth's hidden states and the embedding of the token k places ahead (one "
    "transformer layer each, of the last decoder layer's kind, MoE or dense; the output layer "
    "shared); their losses train the model, the loss "
    "reported is the main one's, each depth's is logged as 'mtp_k loss'",
    "mtp_loss_scaling_factor": "the weight of the depths' mean loss in training",
}
