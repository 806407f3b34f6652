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


def assert_each_document_on_its_own(net: object, eod: int = 99) -> None:
    """Under --reset-position-ids and --reset-attention-mask (the documents' positions and
    mask, megart.models.documents) ``net``'s (a float64 GPT of 16 tokens, ``eod`` in its
    vocabulary) logits of a packed sample are each document's alone; without the mask they
    differ."""
    import torch

    from megart.models.documents import Documents, document_ids, document_positions

    tokens = torch.randint(0, eod, (2, 16), generator=torch.Generator().manual_seed(5))
    tokens[0, [4, 11]] = eod
    tokens[1, 6] = eod
    ids = document_ids(tokens, eod)
    documents = Documents(document_positions(tokens, eod), ids)
    with torch.no_grad():
        got = net(tokens, documents=documents)
        for b in range(2):
            for d in ids[b].unique():
                cols = (ids[b] == d).nonzero().flatten()
                alone = net(tokens[b : b + 1, cols])[0]
                assert (got[b, cols] - alone).abs().max() < 1e-12
        unmasked = net(tokens, documents=Documents(documents.positions, None))
    assert (unmasked - got).abs().max() > 1e-6
