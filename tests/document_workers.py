"""Document-flag runs (--eod-mask-loss, --reset-position-ids, --reset-attention-mask) on every
rank of a launched test: a tiny GPT on random tokens of NullTokenizer's vocabulary with its
end-of-document id (the vocabulary's last) at about one token in eight."""

from __future__ import annotations

import numpy as np

VOCAB = 63  # NullTokenizer's --vocab-size: ids 0..62, end-of-document 63
EOD = VOCAB
# Wider weights than the default 0.02, whose near-uniform attention would hide positions and
# masks; rope, so that reset positions reach every layer.
RUN = dict(tokenizer_type="NullTokenizer", vocab_size=VOCAB, init_method_std=0.2,
           position_embedding_type="rope", normalization="RMSNorm", swiglu=True)  # fmt: skip
FLAGS = dict(eod_mask_loss=True, reset_position_ids=True, reset_attention_mask=True)
# Under the documents' mask rope's reset positions change nothing (rope sees relative positions,
# and those within a document are the same): positions without the mask, to test them.
POSITIONS = dict(eod_mask_loss=True, reset_position_ids=True)


def corpus(n: int = 1 << 14, seed: int = 0, eod_share: float = 0.125) -> np.ndarray:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, VOCAB, n)
    tokens[rng.random(n) < eod_share] = EOD
    return tokens


def trainer(**kw: object):
    import train_workers as tw
    from megart.training.trainer import Trainer

    return Trainer(tw.tiny(**{**RUN, **kw}), tokens=corpus())


def losses(kw: dict) -> list[float]:
    """The loss and gradient norm of each iteration on this rank (the same on every rank): the
    norm as well, since Adam would hide a gradient scaled by a constant (a normalisation by the
    wrong token count) from the loss curve."""
    return [h[k] for h in trainer(**kw).train(quiet=True) for k in ("loss", "grad_norm")]
