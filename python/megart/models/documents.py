"""Documents inside a sample: Megatron-LM's --reset-position-ids, --reset-attention-mask and
--eod-mask-loss, from the positions of the end-of-document (EOD) token in a sample's input
tokens (Megatron-Core's GPTDataset looks at the inputs, not the labels).

A sample ``tokens[0..s)`` is cut after each EOD: the EOD ends its document, the next token
starts a new one. Then
- positions restart at 0 at each document's first token (--reset-position-ids);
- a token attends only to earlier tokens of its own document, the EOD that ends it included
  (--reset-attention-mask: block-diagonal causal);
- the loss of the prediction made *from* an EOD (of the next document's first token) is left
  out (--eod-mask-loss), and nothing else.

Everything here is vectorised over any leading dimensions ([s], [b, s], ...).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def document_ids(tokens: torch.Tensor, eod: int) -> torch.Tensor:
    """The document of each token: how many EODs come strictly before it (an EOD belongs to
    the document it ends)."""
    ends = (tokens == eod).long()
    return ends.cumsum(-1) - ends


def document_positions(tokens: torch.Tensor, eod: int) -> torch.Tensor:
    """Each token's position within its document (0 at the token after each EOD)."""
    index = torch.arange(tokens.shape[-1], device=tokens.device).expand_as(tokens)
    # The start a token opens for the tokens after it: index + 1 after an EOD, else 0; the
    # running maximum up to (not including) a token is its document's start.
    after = torch.where(tokens == eod, index + 1, torch.zeros_like(index))
    starts = after.cummax(-1).values
    starts = torch.cat([torch.zeros_like(starts[..., :1]), starts[..., :-1]], dim=-1)
    return index - starts


def eod_loss_mask(tokens: torch.Tensor, eod: int) -> torch.Tensor:
    """1.0 where the input token is not an EOD, 0.0 where it is (float, as Megatron's)."""
    return (tokens != eod).float()


def document_attention_mask(ids: torch.Tensor) -> torch.Tensor:
    """[b, 1, s, s] booleans from document ids [b, s] (document_ids): query i may attend to
    key j when j <= i and both are of one document. Every row holds its own diagonal, so no
    query is left without a key."""
    s = ids.shape[-1]
    causal = torch.ones(s, s, dtype=torch.bool, device=ids.device).tril()
    return ((ids.unsqueeze(-1) == ids.unsqueeze(-2)) & causal).unsqueeze(1)


@dataclass
class Documents:
    """What a model chunk needs of one microbatch's documents: ``positions`` [b, s] (this
    rank's tokens' positions within their documents, context-parallel split alike; None: the
    sample's own positions) and ``ids`` [b, s] (document ids, for the attention mask; None:
    one causal mask over the sample)."""

    positions: torch.Tensor | None = None
    ids: torch.Tensor | None = None

    def attention_mask(self) -> torch.Tensor | None:
        return None if self.ids is None else document_attention_mask(self.ids)
