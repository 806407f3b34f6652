"""Sliding-window attention: Megatron-LM's --window-size and --window-attn-skip-freq
(TransformerConfig.window_size, window_attn_skip_freq), Mistral's sliding window.

Megatron's window_size is (left, right), -1 meaning unbounded: the query at position i attends
to the keys at positions i - left .. i + right (the diagonals of Megatron-Core's
get_sliding_window_causal_mask; flash attention's window_size, which Transformer Engine takes).
A GPT's attention is causal, so right is 0: Transformer Engine sets it to 0 under a causal mask
(with a warning), and Megatron-Core's local path would let queries read later tokens, so megart
takes (left, 0) only. Token i then sees tokens i - left .. i, left + 1 of them. Hugging Face's
sliding_window w counts the keys instead (key > query - w: query - w + 1 .. query), so it is
Megatron's left w - 1.

--window-attn-skip-freq picks the windowed layers (numbered from 1, as Megatron-Core's
is_layer_window_attention): an integer N windows every layer but each N-th; a list of 0s and 1s,
one per layer, windows the layers marked 1. Without it every layer is windowed.

Positions are global: under context parallelism a rank's queries and the gathered keys are
compared by their places in the whole sequence (megart.models.context_parallel.causal_mask);
under the all-to-all exchange each rank holds some heads over the whole sequence in order, so
the window applies as in one process (sequence_attention, in query tiles when the window is
much shorter than the sequence: megart.models.window_tiles); the ring masks each step's block by
them (megart.models.ring_attention.BlockWindow).
With documents (--reset-attention-mask) the window and the documents' mask both apply.
"""

from __future__ import annotations

import ast
import operator

import torch
import torch.nn.functional as F

from megart.errors import ConfigError
from megart.models.sinks import sink_attention
from megart.models.window_masks import as_bias, bias_dtype, sliding_causal_bias
from megart.models.window_tiles import band_tile, tiled_window_attention

Window = tuple[int, int]
SkipFreq = int | tuple[int, ...]


def layer_window(window: Window | None, skip_freq: SkipFreq | None, layer: int) -> int | None:
    """How many earlier tokens layer ``layer`` (0-based) attends to besides each token itself,
    or None for the whole causal past (no window, an unbounded one, or a skipped layer)."""
    if window is None or window[0] < 0:
        return None
    number = layer + 1  # Megatron numbers layers from 1
    if isinstance(skip_freq, int) and number % skip_freq == 0:
        return None
    if isinstance(skip_freq, tuple) and not skip_freq[layer]:
        return None
    return window[0]


def any_windowed(window: Window | None, skip_freq: SkipFreq | None, num_layers: int) -> bool:
    """Whether some layer of ``num_layers`` attends within a window (layer_window)."""
    return any(layer_window(window, skip_freq, i) is not None for i in range(num_layers))


def covers(left: int | None, seq: int) -> bool:
    """Whether a window of ``left`` earlier tokens reaches every earlier token of a ``seq``-token
    sequence, so that it masks nothing beyond causality."""
    return left is None or left >= seq - 1


def sequence_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout: float,
    window: int | None = None,
    mask: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    sink: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention over a whole sequence in its order ([b, heads, s, d], keys and values
    repeated per query head), within ``window`` earlier tokens and where ``mask`` allows: one
    process's attention, and each all-to-all rank's (its heads over the whole sequence). Without
    a window or mask torch's causal kernels apply (flash on a GPU); a window much shorter than
    the sequence runs in query tiles, each over the keys its windows reach with one small mask
    (megart.models.window_tiles); otherwise an explicit s x s mask. ``scale`` multiplies the
    scores in place of 1/sqrt(q's width) (multi-latent attention's YaRN, which takes no window).
    ``sink``: each head's sink logit (megart.models.sinks), the window and mask as one bias."""
    if window is not None and scale is not None:
        raise NotImplementedError("a sliding window with another softmax scale")
    if mask is not None:  # documents': one bias for every layer (window_masks.as_bias)
        mask = as_bias(mask, bias_dtype(q))
    if window is not None:
        tile = None if sink is not None else band_tile(q.shape[2], window)
        if tile is not None:
            return tiled_window_attention(q, k, v, dropout, window, tile, mask)
        # The cached bias, one tensor for every call (window_masks); with documents, a sum.
        bias = sliding_causal_bias(q.shape[2], window, bias_dtype(q), q.device)
        mask = bias if mask is None else mask + bias
    if sink is not None:
        return sink_attention(q, k, v, sink, dropout, mask)
    if mask is not None:  # a mask tensor: on CUDA no flash kernel takes one
        return F.scaled_dot_product_attention(q, k, v, mask, dropout_p=dropout, scale=scale)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout, scale=scale)


def refuse_window(
    window: Window | None, skip_freq: SkipFreq | None, num_layers: int, fmt: str
) -> None:
    """Refuses a model with a window in some layer for a checkpoint format ``fmt`` that has
    none (it would load as full causal attention: another model)."""
    if any_windowed(window, skip_freq, num_layers):
        assert window is not None
        pattern = "" if skip_freq is None else f" --window-attn-skip-freq {skip_freq}"
        raise ConfigError(
            f"a {fmt} checkpoint cannot represent --window-size {window[0]},{window[1]}"
            f"{pattern} (sliding-window attention; megart writes {fmt} configs without one)"
        )


def check_window(window: Window | None, skip_freq: SkipFreq | None, num_layers: int) -> None:
    """Refuses a window or layer pattern megart cannot take, naming the flag."""
    if window is not None:
        if len(window) != 2:
            raise ConfigError(
                f"--window-size {','.join(map(str, window))}: give two numbers LEFT,RIGHT (as "
                "Megatron-LM's), e.g. 4095,0 for a window of 4096 tokens"
            )
        left, right = window
        if right != 0:
            raise ConfigError(
                f"--window-size {left},{right}: a GPT's attention is causal, so RIGHT (the later "
                f"tokens a query sees) must be 0; give --window-size {left},0 (Transformer "
                "Engine sets it to 0 itself)"
            )
        if left < -1:
            raise ConfigError(
                f"--window-size {left},{right}: LEFT is the earlier tokens each token sees, at "
                "least 0, or -1 for all of them"
            )
    if skip_freq is None:
        return
    if window is None:
        raise ConfigError(
            "--window-attn-skip-freq picks the layers without --window-size's window: add "
            "--window-size (Megatron ignores it without; megart refuses rather than ignore it)"
        )
    if isinstance(skip_freq, int) and skip_freq < 1:
        raise ConfigError(
            f"--window-attn-skip-freq {skip_freq}: every N-th layer attends to the whole "
            "sequence, so N must be at least 1"
        )
    if isinstance(skip_freq, tuple) and (
        len(skip_freq) != num_layers or any(x not in (0, 1) for x in skip_freq)
    ):
        raise ConfigError(
            f"--window-attn-skip-freq {list(skip_freq)}: give one 0 (whole sequence) or 1 "
            f"(window) per layer, {num_layers} of them (--num-layers)"
        )


def parse_window_size(text: str) -> Window:
    """--window-size's value, "LEFT,RIGHT" or "(LEFT,RIGHT)" (Megatron-LM's tuple_type)."""
    try:
        return tuple(int(x) for x in text.strip().strip("()").split(","))  # type: ignore[return-value]
    except ValueError:
        raise ConfigError(
            f"--window-size {text}: give two integers LEFT,RIGHT, e.g. 4095,0"
        ) from None


def as_flag_text(window_size: object, skip_freq: object) -> tuple[str | None, str | None]:
    """--window-size and --window-attn-skip-freq as the flags spell them, from the flags'
    strings or, through the Python API, Megatron-Core's TransformerConfig values: (left,
    right), and an integer or a list of 0s and 1s per layer."""

    def ints(value: object) -> bool:
        return isinstance(value, (tuple, list)) and all(type(x) is int for x in value)

    window = ",".join(map(str, window_size)) if ints(window_size) else window_size
    skip = skip_freq
    if type(skip) is int:
        skip = str(skip)
    elif ints(skip):
        skip = str(list(skip))
    for flag, value in (("--window-size", window), ("--window-attn-skip-freq", skip)):
        if value is not None and not isinstance(value, str):
            raise ConfigError(
                f"{flag} {value!r}: give the flag's text, or as Megatron-Core's TransformerConfig "
                "takes it: (LEFT, RIGHT) for the window, an integer or a list of 0s and 1s per "
                "layer for the skip frequency"
            )
    return window, skip


LONGEST = 1 << 16
_OPS = {ast.Add: operator.add, ast.Mult: operator.mul}


def parse_skip_freq(text: str, flag: str = "--window-attn-skip-freq") -> SkipFreq:
    """--window-attn-skip-freq's value (or another ``flag`` of Megatron-LM's moe_freq_type,
    such as --moe-layer-freq): an integer N, or a Python list expression of 0s and 1s such as
    "([1]*3+[0])*2" (here read without eval: lists, integers, + and * only)."""

    def value(node: ast.AST) -> object:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.List):
            return [value(x) for x in node.elts]
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = value(node.left), value(node.right)
            if any(isinstance(x, int) and x > LONGEST for x in (left, right)):
                raise ValueError  # bounds a repeated list: no model has that many layers
            return _OPS[type(node.op)](left, right)
        raise ValueError

    try:
        got = value(ast.parse(text.strip(), mode="eval").body)
        if isinstance(got, int):
            return got
        if isinstance(got, list) and all(type(x) is int for x in got):
            return tuple(got)
    except (SyntaxError, ValueError, TypeError):
        pass
    meaning = {"--moe-layer-freq": "every N-th layer MoE, from the first"}
    raise ConfigError(
        f"{flag} {text}: give an integer N "
        f"({meaning.get(flag, 'every N-th layer without the window')}) or a list of 0s and 1s "
        'per layer, e.g. "([1]*3+[0])*2"'
    )
