"""What Megatron-LM's document flags (--reset-attention-mask, --reset-position-ids,
--eod-mask-loss; megart.training.documents) add to a rank's memory, as megart train holds it.

--reset-attention-mask. Each chunk's forward builds its microbatch's documents' mask, [b, 1, s, s]
booleans (megart.models.documents), and its layers' attention takes it as one additive bias,
[b, 1, s, s] in the attention's dtype (fp32, or 16-bit under --bf16/--fp16 autocast and
--half-weights) with rows ALIGN-strided: b s ceil(s/16) 16 elements (megart.models.window_masks:
additive_bias, as_bias, which keeps the last mask given, its bias with it, and hands the same
bias to consecutive calls with that mask). Who holds what, per (microbatch, chunk) pair the
schedule holds between its forward and backward:
- without recomputation every layer's attention saves the bias (one tensor): a bias per pair;
  the boolean mask is kept only by as_bias, the last one: one mask per rank;
- under selective or full recomputation the attention runs inside checkpoints, which save
  nothing of it but keep their inputs, the boolean mask among them (selective's arguments,
  full's closure over the chunk's mask): a boolean mask per pair; the bias is kept only by
  as_bias, the last one: one bias per rank. A backward's replay makes its pair's bias anew
  (the one as_bias kept is another pair's, and is freed for it), which the replayed layers
  save: still one bias.
Measured on real CPU ranks (tests/test_plan_documents.py: saved-tensor hooks, and the masks
and biases held for as long as they live). What a GPU's kernel keeps is a model, unverified on
a GPU: no flash kernel takes a mask tensor, so torch runs the memory-efficient kernel with the
bias, which saves q, k, v, its output, its fp32 log-sum-exp (rows padded to 32, not counted,
as for fp32 runs, which take that kernel already) and the bias itself, as a view of the
cached one when its rows are 16-aligned (hence ALIGN): what a CPU's flash kernel saves too
(torch 2.13, measured). Its output is laid out sequence-major whatever q's layout, so that
with rope the projection's input is a view rather than the copy counted (h/t per token fewer;
not modelled, as for fp32 runs). On a CPU, attention dropout > 0 sends the call to the math
kernel, which keeps s x s matrices: the tests run without it.

--reset-position-ids. Rope's cos and sin are then indexed by each sample's positions: [b, s,
rotary_dim/2] each per pair instead of [s, rotary_dim/2] (b times rope_table_bytes). The learned
table is indexed by the positions, and the index keeps them: b s int64 per pair on the first
stage (in place of the s global positions it keeps with context parallelism).

--eod-mask-loss. The loss multiplies each token's loss by the fp32 loss mask, which it keeps
until its backward, and divides by the count of unmasked tokens: b s 4 + 4 bytes on the last
stage.

Not counted: the iteration's document ids and positions (b s int64 each per microbatch, held
by the trainer for the whole iteration, as the input tokens are), and the transients of
building a mask (s x s and b x s x s booleans, during a forward).
"""

from __future__ import annotations

import dataclasses

from megart.errors import ConfigError
from megart.models.window_masks import bias_row_stride
from megart.plan.activations import Precision, rope_table_bytes
from megart.plan.window_memory import masking_window
from megart.training.config import TrainConfig
from megart.training.documents import given
from megart.training.megatron_flags import ResolvedVocabulary


def mask_bytes(c: TrainConfig, b: int, prec: Precision) -> tuple[float, float]:
    """--reset-attention-mask's (bytes per held (microbatch, chunk) pair, bytes once per rank):
    without recomputation a bias per pair and the last boolean mask; under selective or full
    recomputation a boolean mask per pair and the last bias (the module's doc). The bias is in
    the attention's dtype, the saved activations' (``prec.other``). None without the flag."""
    if not c.reset_attention_mask:
        return 0.0, 0.0
    s = c.seq_length
    bias = b * s * bias_row_stride(s) * prec.other
    booleans = b * s * s
    cfg = c.gpt_config()
    # A checkpoint of the attention (full, or selective's core_attn) keeps the booleans.
    if not (cfg.recompute_granularity == "full" or cfg.recomputes("core_attn")):
        return float(bias), float(booleans)
    return float(booleans), float(bias)


def positions_bytes(c: TrainConfig, b: int, cp: int, first_stage: bool) -> float:
    """--reset-position-ids' bytes per held pair beyond a plan without it: rope's tables per
    sample (b - 1 more of rope_table_bytes), or on the first stage the learned table's int64
    index, b s/cp positions instead of the s/cp global ones it keeps with context
    parallelism (activations.first_stage_bytes)."""
    if not c.reset_position_ids:
        return 0.0
    cfg = c.gpt_config()
    if cfg.position_embedding == "rotary":
        return (b - 1) * rope_table_bytes(cfg, cp)
    if not first_stage:
        return 0.0
    local = cfg.seq_length // cp
    return b * local * 8.0 - (local * 8 if cp > 1 else 0)


def loss_mask_bytes(c: TrainConfig, b: int, cp: int) -> float:
    """--eod-mask-loss: the fp32 loss mask the last stage's loss keeps, b s/cp elements, and
    the fp32 count of unmasked tokens it divides by (a number, not a tensor, under
    --calculate-per-token-loss)."""
    if not c.eod_mask_loss:
        return 0.0
    return b * (c.seq_length // cp) * 4.0 + (0 if c.calculate_per_token_loss else 4)


def refuse_windowed_documents(c: TrainConfig) -> None:
    """Refuses --reset-attention-mask with layers whose sliding window masks something: each
    such layer adds the window's bias to the documents' (a new tensor per layer, per query tile
    when tiled, megart.models.window), which the planner does not model."""
    if not c.reset_attention_mask:
        return
    cfg = c.gpt_config()
    if any(masking_window(cfg, i) is not None for i in range(cfg.num_layers)):
        raise ConfigError(
            "megart plan does not model --reset-attention-mask with --window-size "
            f"{cfg.window_size[0]},{cfg.window_size[1]} (each windowed layer's own sum of "
            "the window's and the documents' biases): leave one of them out to plan it"
        )


def with_end_of_document(base: TrainConfig) -> TrainConfig:
    """megart plan's base config (its tokenizer's flags reset once the vocabulary is resolved,
    megart.cli.plan) made to pass the document flags' check on every candidate: that check
    asks for an end-of-document id (training.documents.eod_token), which the command line's
    config, checked before, has. Unchanged without the document flags."""
    if not given(base):
        return base
    # NullTokenizer's end-of-document id is its last; the vocabulary stays as resolved.
    vocab = ResolvedVocabulary(base.vocab_size, "NullTokenizer")
    return dataclasses.replace(base, tokenizer_type="NullTokenizer", vocab_size=vocab)
