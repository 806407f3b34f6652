"""FLOPs of one training iteration, per the SC21 paper (Narayanan et al., appendix):

    with full activation recomputation:  96 B s l h^2 (1 + s/(6h) + V/(16 l h))
    without (the usual MFU numerator):   72 B s l h^2 (1 + s/(6h) + V/(12 l h))

B global batch (sequences), s sequence length, l layers, h hidden size, V vocabulary.
"""

from __future__ import annotations

# Dense bf16 peak per GPU, FLOP/s (datasheets); MFU is reported against the one that applies.
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12}


def iteration_flops(
    batch: int, seq: int, layers: int, hidden: int, vocab: int, recompute: bool = False
) -> float:
    """Model FLOPs of one iteration (forward and backward, plus the recomputed forward when
    ``recompute``)."""
    b, s, l, h, v = batch, seq, layers, hidden, vocab
    if recompute:
        return 96 * b * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))
    return 72 * b * s * l * h * h * (1 + s / (6 * h) + v / (12 * l * h))


def parameter_count(layers: int, hidden: int, vocab: int, seq: int) -> float:
    """P = 12 l h^2 (1 + 13/(12h) + (V+s)/(12 l h)): weights, biases, norms, embeddings."""
    l, h = layers, hidden
    return 12 * l * h * h * (1 + 13 / (12 * h) + (vocab + seq) / (12 * l * h))
