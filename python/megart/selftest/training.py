"""A few training iterations of a tiny GPT, compared with the one-process CPU loss curve."""

from __future__ import annotations

from typing import Any

from megart.selftest.report import Check, judged

# The tiny run: small enough for seconds on a CPU, with every layout's sizes dividing it.
TINY = dict(
    num_layers=4,
    hidden_size=32,
    num_attention_heads=4,
    seq_length=16,
    micro_batch_size=2,
    global_batch_size=8,
    train_iters=3,
    lr=1e-3,
    min_lr=1e-4,
    lr_warmup_iters=1,
    eval_iters=0,
    # Without dropout, so that every layout's curve is the same function of the weights.
    hidden_dropout=0.0,
    attention_dropout=0.0,
)


def curve(**kw: Any) -> list[dict]:
    """Trains the tiny GPT (with ``kw`` as TrainConfig fields) on the built-in corpus; returns
    the per-iteration log. Uses (and leaves) megart.distributed as initialised, or starts it."""
    from megart.training.config import TrainConfig
    from megart.training.data import builtin_corpus
    from megart.training.trainer import Trainer

    trainer = Trainer(TrainConfig(**{**TINY, **kw}), tokens=builtin_corpus(1 << 16))
    return trainer.train(quiet=True)


# A Llama-style tiny GPT with what its layouts add: query/key norms, whose gradients are summed
# over tensor parallelism, and SwiGLU's one entry into the tensor-parallel region.
LLAMA = dict(
    normalization="RMSNorm",
    position_embedding_type="rope",
    swiglu=True,
    disable_bias_linear=True,
    group_query_attention=True,
    num_query_groups=2,
    qk_layernorm=True,
    untie_embeddings_and_output_weights=True,
)


def one_process_curve(kw: dict | None = None) -> list[dict]:
    """The reference (of the tiny GPT with ``kw``), in a one-process world of its own
    (destroyed afterwards)."""
    import megart.distributed as dist

    try:
        return curve(**(kw or {}))
    finally:
        dist.destroy()


def compare_curves(
    name: str, got: list[dict], want: list[dict], rtol: float, avoid: str | None
) -> Check:
    """Largest relative difference of loss and gradient norm over the iterations."""
    if [h["iteration"] for h in got] != [h["iteration"] for h in want]:
        return judged(name, float("inf"), rtol, avoid=avoid, what="iterations differ, ")
    err = max(
        abs(g[k] - w[k]) / max(abs(w[k]), 1e-12)
        for g, w in zip(got, want, strict=True)
        for k in ("loss", "grad_norm")
    )
    return judged(name, err, rtol, avoid=avoid, what=f"{len(want)} iterations vs one process, ")
