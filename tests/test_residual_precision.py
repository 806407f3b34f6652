"""The residual stream's precision under --bf16/--fp16: 16-bit from the embedding on, as in
Megatron-LM (whose 16-bit weights make it so), or fp32 with --fp32-residual-connection. The
stream is what crosses pipeline stages, so it sets the pipeline's bytes; norms run in it, with
their fp32 weights cast to it."""

from __future__ import annotations

import pytest
import torch

import train_workers as tw
from megart.launcher import launch
from megart.models import GPTConfig
from megart.models.blocks import Block
from megart.models.gpt import GPT

HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}
TINY = dict(vocab_size=64, seq_length=16, hidden_size=32, num_layers=3, num_attention_heads=4)


def _stream_dtypes(
    cfg: GPTConfig, dtype: torch.dtype | None, half_weights: bool = False
) -> list[torch.dtype]:
    """The dtype of every block's output, and of every norm's output where the norm module
    runs (the fused kernel's path calls no module), in a forward and backward under autocast
    to ``dtype`` (None: no autocast); with ``half_weights`` the weights themselves in
    ``dtype`` (--half-weights)."""
    model = GPT(cfg)
    weights = torch.float32
    if half_weights:
        assert dtype is not None
        model, weights = model.to(dtype), dtype
    seen: list[torch.dtype] = []
    for block in model.chunk.blocks:
        block.register_forward_hook(lambda mod, args, out: seen.append(out.dtype))
    norms = [m for name, m in model.named_modules() if name.rsplit(".", 1)[-1].startswith("ln_")]
    for norm in norms:
        norm.register_forward_hook(lambda mod, args, out: seen.append(out.dtype))
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length), generator=torch.Generator())
    with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
        loss = model(tokens, tokens)
    loss.backward()
    assert all(p.grad is not None and p.grad.dtype == weights for p in model.parameters())
    return seen


# Each norm kind, and how many outputs _stream_dtypes sees with it: the 3 blocks' and, unless
# fused (no module runs), their 2 norms each and the final one.
NORMS = pytest.mark.parametrize(
    "norms",
    [
        dict(normalization="layernorm"),
        dict(normalization="layernorm", fused_layer_norm=True),
        dict(normalization="rmsnorm"),
    ],
    ids=["layernorm", "fused-layernorm", "rmsnorm"],
)


def _outputs(norms: dict) -> int:
    return 3 if norms.get("fused_layer_norm") else 3 + 7


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@NORMS
def test_the_stream_is_autocasts_type_unless_fp32_residual_connection(precision, norms):
    kw = dict(TINY, **norms)
    half = HALF[precision]
    seen = _outputs(norms)
    assert _stream_dtypes(GPTConfig(**kw), half) == [half] * seen
    # The fp32 stream's norms give fp32 (on CPU autocast leaves LayerNorm alone; on CUDA it
    # runs it in fp32), and so does RMSNorm's scale by its fp32 weight.
    wide = _stream_dtypes(GPTConfig(**kw, fp32_residual_connection=True), half)
    assert wide == [torch.float32] * seen
    # Without autocast nothing is cast, whatever the flag.
    assert _stream_dtypes(GPTConfig(**kw), None) == [torch.float32] * seen


@NORMS
def test_16_bit_weights_keep_the_fp32_stream_when_asked(norms):
    # --half-weights looks up 16-bit embeddings: --fp32-residual-connection casts them to fp32
    # (as Megatron-LM's embedding does), and the norms take their 16-bit weights to it.
    kw = dict(TINY, **norms)
    seen = _outputs(norms)
    wide = GPTConfig(**kw, fp32_residual_connection=True)
    assert _stream_dtypes(wide, torch.bfloat16, half_weights=True) == [torch.float32] * seen
    narrow = _stream_dtypes(GPTConfig(**kw), torch.bfloat16, half_weights=True)
    assert narrow == [torch.bfloat16] * seen


def test_half_weights_with_the_fp32_stream_cross_pipeline_stages_in_fp32():
    """--bf16 --half-weights --fp32-residual-connection under pp2: fp32 messages and the
    one-process curve (the first stage once sent the bf16 stream its peer did not expect)."""
    kw = dict(bf16=True, half_weights=True, fp32_residual_connection=True)
    one = launch(tw.train_kw, 1, kw, timeout=300)[0]
    pp2 = launch(tw.train_kw, 2, dict(kw, pipeline_model_parallel_size=2), timeout=300)[0]
    for h, r in zip(pp2, one, strict=True):
        assert h["loss"] == pytest.approx(r["loss"], rel=1e-5)
    assert [h["pipeline_p2p_bytes"] for h in pp2] == [2 * 4 * 16 * 2 * 32 * 4] * 3


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).norm() / want.norm()).item()


@pytest.mark.parametrize("fused_layer_norm", [False, True])
def test_a_block_on_a_bf16_stream_matches_float64(fused_layer_norm):
    """A layer fed and giving a bf16 stream, its fp32 weights autocast: output, input gradient
    and every weight gradient (the norms' reach their fp32 weights through the cast) against
    the same layer in float64. bf16 keeps 8 bits: a few roundings give up to 7e-3 norm-wise
    here. A cast that drops the norms' gradients, a norm applied without its weight, or a
    stream left in fp32 (the dtype check) fail."""
    cfg = GPTConfig(**TINY, fused_layer_norm=fused_layer_norm, bias_gelu_fusion=True)
    block = Block(cfg, 0, None, False)
    with torch.no_grad():  # weights away from LayerNorm's initial 1 and 0
        for p in block.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    exact = Block(cfg, 0, None, False).double()
    exact.load_state_dict(block.state_dict())
    x = torch.randn(16, 2, 32, generator=torch.Generator().manual_seed(0)).bfloat16()
    x.requires_grad_(True)
    x64 = x.detach().double().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = block(x)
    assert y.dtype == torch.bfloat16
    y64 = exact(x64)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(1))
    y.backward(dy.bfloat16())
    y64.backward(dy.bfloat16().double())
    assert _relative_error(y, y64) < 1.5e-2
    assert _relative_error(x.grad, x64.grad) < 1.5e-2
    exact_params = dict(exact.named_parameters())
    for name, p in block.named_parameters():
        assert p.grad is not None and p.grad.dtype == torch.float32, name
        assert _relative_error(p.grad, exact_params[name].grad) < 1.5e-2, name


def test_pipeline_messages_are_16_bit_and_both_streams_follow_their_one_process_curve():
    """pp2 under --bf16: each message is the bf16 stream (half the bytes of
    --fp32-residual-connection's), and each run follows the one-process run of its own flags
    (a pipeline changes no arithmetic: the same products in the same order); the two streams
    round differently, and both stay near the fp32 curve."""
    fp32 = launch(tw.train_kw, 1, {}, timeout=300)[0]
    curves = {}
    for wide in (False, True):
        kw = dict(bf16=True, fp32_residual_connection=wide)
        one = launch(tw.train_kw, 1, kw, timeout=300)[0]
        pp2 = launch(tw.train_kw, 2, dict(kw, pipeline_model_parallel_size=2), timeout=300)[0]
        for h, r, f in zip(pp2, one, fp32, strict=True):
            assert h["loss"] == pytest.approx(r["loss"], rel=1e-5)
            assert h["loss"] == pytest.approx(f["loss"], rel=2e-2)
        # m = 4 microbatches, an activation and its gradient each: s x b x h elements.
        assert [h["pipeline_p2p_bytes"] for h in pp2] == [
            2 * 4 * 16 * 2 * 32 * (4 if wide else 2)
        ] * 3
        curves[wide] = [h["loss"] for h in one]
    assert curves[False] != curves[True]


@pytest.mark.parametrize("tied", [True, False])
def test_sequence_parallel_entries_gather_16_bit_elements_from_the_fp32_stream(tied):
    """Under --fp32-residual-connection every column-parallel entry, the output layer's tied to
    the embedding or not, takes the fp32 norm output to autocast's type before it gathers the
    sequence (half the bytes; the products would cast it anyway)."""
    kw = dict(bf16=True, fp32_residual_connection=True, tensor_model_parallel_size=2,
              sequence_parallel=True, untie_embeddings_and_output_weights=not tied)  # fmt: skip
    for dtypes in launch(tw.gathered_dtypes, 2, kw, timeout=300):
        # Per layer q/k/v's and the MLP's entries, and the output layer's, in the forward.
        assert len(dtypes) >= 2 * 4 + 1 and set(dtypes) == {"torch.bfloat16"}, dtypes
