"""The pieces of a GPT layer, tensor-parallel: norms, rotary positions, attention, the MLP.

Activations are [s, b, h] (sequence first, Megatron's layout): sequence parallelism splits
dimension 0. Each parameter is drawn from a generator seeded by (model seed, layer, name), so a
parameter's initial value does not depend on which stage or rank builds it.
"""

from __future__ import annotations

import contextlib
import hashlib
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from megart.distributed import ProcessGroup
from megart.kernels import add_layer_norm, bias_gelu, layer_norm
from megart.models.all_to_all_attention import all_to_all_attention
from megart.models.config import GPTConfig
from megart.models.context_parallel import context_attention, gather_kv
from megart.models.recompute import checkpointed
from megart.models.ring_attention import ring_attention
from megart.tensor_parallel import (
    ColumnParallelLinear,
    RNGStatesTracker,
    RowParallelLinear,
    normal_init,
)
from megart.tensor_parallel._group import group_rank, group_size


def generator(seed: int, *where: object) -> torch.Generator:
    """A generator for one parameter, seeded by the model seed and the parameter's place."""
    digest = hashlib.sha256(repr((seed, *where)).encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def gamma(module: nn.Module) -> torch.Tensor:
    """The scale a norm multiplies by: its weight, or 1 + weight when the weight is stored
    zero-centred (Megatron's --apply-layernorm-1p)."""
    return module.weight + 1 if getattr(module, "zero_centered_gamma", False) else module.weight


HALF = (torch.bfloat16, torch.float16)


def in_dtype(dtype: torch.dtype, *params: torch.Tensor | None) -> list[torch.Tensor | None]:
    """A norm's weights in its input's ``dtype`` when that is 16-bit (a 16-bit residual stream,
    as Megatron-LM's 16-bit weights give it); unchanged for fp32 and float64 inputs. The
    gradient reaches the fp32 weights through the cast, rounded to 16 bits as Megatron's is."""
    if dtype not in HALF:
        return list(params)
    return [None if p is None else p.to(dtype) for p in params]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, zero_centered_gamma: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.zero_centered_gamma = zero_centered_gamma
        # Either way the initial scale is 1.
        self.weight = nn.Parameter(torch.zeros(dim) if zero_centered_gamma else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # 16-bit inputs are normalised in fp32 (as Megatron's and Hugging Face's RMSNorm do),
        # then scaled in their own dtype; float64 stays float64.
        wide = x.to(torch.promote_types(x.dtype, torch.float32))
        normed = (wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x)
        return normed * in_dtype(x.dtype, gamma(self))[0]


class LayerNorm(nn.LayerNorm):
    """nn.LayerNorm, with the option of a zero-centred weight: stored as scale - 1, so that
    the initial weight is zero (as Megatron's --apply-layernorm-1p); the bias is unchanged.

    A 16-bit input is normalised in its own dtype (fp32 arithmetic inside, the output and the
    input saved for backward 16-bit), with autocast off: CUDA's autocast would run LayerNorm on
    an fp32 copy of the input and keep that copy."""

    def __init__(self, dim: int, eps: float, bias: bool, zero_centered_gamma: bool) -> None:
        super().__init__(dim, eps=eps, bias=bias)
        self.zero_centered_gamma = zero_centered_gamma
        if zero_centered_gamma:
            with torch.no_grad():
                self.weight.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype not in HALF:
            return F.layer_norm(x, self.normalized_shape, gamma(self), self.bias, self.eps)
        weight, bias = in_dtype(x.dtype, gamma(self), self.bias)
        with torch.autocast(x.device.type, enabled=False):
            return F.layer_norm(x, self.normalized_shape, weight, bias, self.eps)


def norm(cfg: GPTConfig, sequence_parallel: bool, size: int | None = None) -> nn.Module:
    """A LayerNorm or RMSNorm over ``size`` channels (default the hidden size). Under sequence
    parallelism each rank normalises its own slice of the sequence, so the weights' gradients
    are partial sums, marked for a sum across t."""
    centred, size = cfg.apply_layernorm_1p, size or cfg.hidden_size
    if cfg.normalization == "rmsnorm":
        module: nn.Module = RMSNorm(size, cfg.layernorm_epsilon, centred)
    else:
        module = LayerNorm(size, cfg.layernorm_epsilon, cfg.bias, centred)
    for p in module.parameters():
        p.sequence_parallel = sequence_parallel
    return module


def apply_norm(module: nn.Module, x: torch.Tensor, fused: bool) -> torch.Tensor:
    """``module(x)``; with ``fused`` a LayerNorm runs through megart.kernels.layer_norm."""
    if fused and isinstance(module, nn.LayerNorm):
        # The kernel takes the scale itself; autograd carries its gradient to a zero-centred
        # weight unchanged (d(1 + w)/dw = 1).
        return layer_norm(x, *in_dtype(x.dtype, gamma(module), module.bias), module.eps)
    return module(x)


# Llama 3.x's frequency scaling: the constants Meta's Llama 3.1 and 3.2 use, which
# Megatron-Core fixes (only the factor is a flag) and Hugging Face's "llama3" rope type
# records as low_freq_factor, high_freq_factor and original_max_position_embeddings.
LLAMA3_LOW_FREQ_FACTOR = 1.0
LLAMA3_HIGH_FREQ_FACTOR = 4.0
LLAMA3_ORIGINAL_CONTEXT = 8192


def llama3_inv_freq(
    inv_freq: torch.Tensor,
    factor: float,
    low_freq_factor: float = LLAMA3_LOW_FREQ_FACTOR,
    high_freq_factor: float = LLAMA3_HIGH_FREQ_FACTOR,
    original_context: int = LLAMA3_ORIGINAL_CONTEXT,
) -> torch.Tensor:
    """rope's inverse frequencies scaled by Llama 3.x's rule (Megatron's --use-rope-scaling
    --rope-scaling-factor; Hugging Face's rope type "llama3"). A frequency whose wavelength
    2 pi / f is longer than original_context / low_freq_factor turned less than once over the
    original context: it is divided by ``factor``, so that a context ``factor`` times longer
    turns it no further than training did. One shorter than original_context / high_freq_factor
    turned several times: it is kept, so nearby positions stay as distinguishable. Between the
    two the frequency blends linearly in original_context / wavelength (the number of turns
    over the original context) from f / factor to f."""
    # Turns over the original context, computed through the wavelength as Megatron-Core and
    # transformers compute it, so that the three agree to the last bit.
    turns = original_context / (2 * math.pi / inv_freq)
    # 0 at the slow end (fully divided), 1 at the fast end (kept), clamped beyond either.
    keep = ((turns - low_freq_factor) / (high_freq_factor - low_freq_factor)).clamp(0.0, 1.0)
    return (1 - keep) * inv_freq / factor + keep * inv_freq


def rotary(
    seq: int,
    dim: int,
    device: torch.device,
    base: float = 10000.0,
    scaling_factor: float | None = None,
    interpolation_factor: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotation angles, [seq, dim/2]: position p turns pair i by
    p base^(-2i/dim) (RoFormer's, base 10000 by default as Megatron's --rotary-base); with
    ``scaling_factor`` those frequencies first scaled by Llama 3.x's rule (llama3_inv_freq);
    with ``interpolation_factor`` F position p turns as p / F would (position interpolation,
    Megatron's --rotary-seq-len-interpolation-factor)."""
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim))
    if scaling_factor is not None:
        inv = llama3_inv_freq(inv, scaling_factor)
    positions = torch.arange(seq, device=device, dtype=torch.float32)
    if interpolation_factor is not None:
        # Times the reciprocal, in float32, as Megatron-Core's RotaryEmbedding computes it, so
        # that the angles are its to the bit (Hugging Face divides the frequencies instead:
        # the same angles to a few units in the last place).
        positions = positions * (1 / interpolation_factor)
    angles = torch.outer(positions, inv)
    return angles.cos(), angles.sin()


def apply_rotary(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False
) -> torch.Tensor:
    """Rotates pairs of the last dimension of x [b, heads, s, d]: (x[i], x[i + d/2]) (the
    halves, Megatron-LM's and Hugging Face Llama's default), or with ``interleaved`` adjacent
    (x[2i], x[2i+1]) (Megatron's --rotary-interleaved, and megart's rotation before it).
    Where cos and sin cover fewer channels than x has (partial rotary, Megatron's
    --rotary-percent), only the first 2 cos.shape[-1] channels turn, paired among themselves
    as above, and the rest pass unchanged. Computed in fp32, or in x's type where it is wider
    (float64, as Megatron-Core computes in it)."""
    turned = 2 * cos.shape[-1]
    if turned < x.shape[-1]:
        rest = x[..., turned:]
        return torch.cat((apply_rotary(x[..., :turned], cos, sin, interleaved), rest), dim=-1)
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    if interleaved:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
        return (
            torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2).type_as(x)
        )
    x1, x2 = xf.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).type_as(x)


class Attention(nn.Module):
    """Causal self-attention with heads split across tensor parallelism: the fused q/k/v
    projection is column-parallel, the output projection row-parallel. Attention dropout runs
    on the tracker's tensor-parallel stream, distinct per rank, as Megatron's does.

    With grouped-query attention (GPTConfig.num_query_groups) the heads share key and value
    heads in groups of heads/groups. The fused projection's rows are grouped per query group
    as [q of the group's heads, k, v], so a rank's contiguous slice holds whole groups (and
    resharding by contiguous row chunks stays right); with one group per head that is [q, k, v]
    per head, the multi-head layout.

    With context parallelism (``cp_group``) each rank holds part of each sequence: keys and
    values are gathered over the group after rope, and attention is causal by the tokens'
    global positions (megart.models.context_parallel.context_attention)."""

    def __init__(
        self,
        cfg: GPTConfig,
        layer: int,
        tp_group: ProcessGroup | None,
        sequence_parallel: bool,
        rng: RNGStatesTracker | None = None,
        cp_group: ProcessGroup | None = None,
    ) -> None:
        super().__init__()
        h, t = cfg.hidden_size, group_size(tp_group)
        self.cfg, self.rng, self.cp_group = cfg, rng, cp_group
        self.local_heads = cfg.num_attention_heads // t
        self.local_groups = cfg.query_groups // t
        out_std = cfg.init_std / math.sqrt(2 * cfg.num_layers)
        self.qkv = ColumnParallelLinear(
            h,
            (cfg.num_attention_heads + 2 * cfg.query_groups) * cfg.head_dim,
            bias=cfg.bias,
            sequence_parallel=sequence_parallel,
            tp_group=tp_group,
            init_method=normal_init(cfg.init_std),
            generator=generator(cfg.seed, layer, "qkv"),
        )
        self.proj = RowParallelLinear(
            h,
            h,
            bias=cfg.bias,
            sequence_parallel=sequence_parallel,
            tp_group=tp_group,
            init_method=normal_init(out_std),
            generator=generator(cfg.seed, layer, "proj"),
        )
        if cfg.qk_layernorm:
            # Each rank normalises its own heads with the same weights: like a sequence-parallel
            # norm's, their gradients are partial sums across t (Megatron-Core sums them too).
            self.q_layernorm = norm(cfg, True, cfg.head_dim)
            self.k_layernorm = norm(cfg, True, cfg.head_dim)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``mask``: [b, 1, s, s] booleans (True: may attend), causal already (documents'
        block-diagonal mask, megart.models.documents); None: causal over the sequence."""
        qkv = self.qkv(x)  # [s, b, (heads + 2 groups) d / t]: whole sequence, rank's groups
        s, b, _ = qkv.shape
        d, per_group = self.cfg.head_dim, self.local_heads // self.local_groups
        grouped = qkv.view(s, b, self.local_groups, per_group + 2, d)
        q, k, v = grouped.split([per_group, 1, 1], dim=3)
        q, k = q.reshape(s, b, self.local_heads, d), k.squeeze(3)
        if self.cfg.qk_layernorm:  # each head over its channels, before rope
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        # [b, heads, s, d] and [b, groups, s, d]: views, with one group per head the very
        # strides the multi-head layout gave.
        q = q.permute(1, 2, 0, 3)
        k, v = k.permute(1, 2, 0, 3), v.squeeze(3).permute(1, 2, 0, 3)
        if rope is not None:
            turn = self.cfg.rotary_interleaved
            q, k = apply_rotary(q, *rope, turn), apply_rotary(k, *rope, turn)
        cp = group_size(self.cp_group)
        where = None  # (cp, cp rank) with context parallelism
        if cp > 1:
            if self.cfg.cp_comm_type == "all_gather":  # else each rank's K/V go round a ring
                k, v = gather_kv(k, self.cp_group), gather_kv(v, self.cp_group)
            where = (cp, group_rank(self.cp_group))
        if self.cfg.recompute_granularity == "selective" and torch.is_grad_enabled():
            y = checkpointed(self._core, self.rng, q, k, v, where, mask)
        else:
            y = self._core(q, k, v, where, mask)
        return self.proj(y.permute(2, 0, 1, 3).reshape(s, b, -1))

    def _core(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        where: tuple[int, int] | None = None,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """softmax(q k^T / sqrt(d)) v, causal (with context parallelism, ``where`` = (cp, cp
        rank), by global positions; with ``mask``, where it allows), with attention dropout on
        the tensor-parallel stream: what selective recomputation recomputes (so it keeps k and v
        per group)."""
        per_group = q.shape[1] // k.shape[1]
        dropout = self.cfg.attention_dropout if self.training else 0.0
        stream = self.rng.fork() if dropout and self.rng else contextlib.nullcontext()
        # Megatron's --attention-backend unfused/local: the softmax of the explicit s x s
        # scores (torch's math kernel); otherwise torch picks flash or fused kernels.
        unfused = self.cfg.attention_backend in ("unfused", "local")
        kernel = sdpa_kernel(SDPBackend.MATH) if unfused else contextlib.nullcontext()
        if where is not None and self.cfg.cp_comm_type != "all_gather":  # the groups' K/V travel
            attend = ring_attention if self.cfg.cp_comm_type == "p2p" else all_to_all_attention
            with stream, kernel:
                return attend(q, k, v, self.cp_group, dropout)
        if per_group > 1:
            # Each group's key and value head, once per query head of the group (heads are
            # numbered group by group). Explicit rather than sdpa's enable_gqa, so that every
            # attention backend and torch's FLOP counter see plain multi-head attention.
            k = k.repeat_interleave(per_group, dim=1)
            v = v.repeat_interleave(per_group, dim=1)
        with stream, kernel:
            if where is not None:
                return context_attention(q, k, v, *where, dropout)
            if mask is not None:  # a mask tensor: on CUDA no flash kernel takes one
                return F.scaled_dot_product_attention(q, k, v, mask, dropout_p=dropout)
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout)


class MLP(nn.Module):
    """h -> ffn (column-parallel) -> GeLU or SwiGLU -> h (row-parallel)."""

    def __init__(
        self, cfg: GPTConfig, layer: int, tp_group: ProcessGroup | None, sequence_parallel: bool
    ) -> None:
        super().__init__()
        h, f = cfg.hidden_size, cfg.ffn_size
        self.swiglu = cfg.activation == "swiglu"
        self.bias_gelu_fusion = cfg.bias_gelu_fusion

        def column(name: str) -> ColumnParallelLinear:
            return ColumnParallelLinear(
                h,
                f,
                bias=cfg.bias,
                sequence_parallel=sequence_parallel,
                tp_group=tp_group,
                init_method=normal_init(cfg.init_std),
                generator=generator(cfg.seed, layer, name),
            )

        self.fc = column("fc")
        self.gate = column("gate") if self.swiglu else None
        self.proj = RowParallelLinear(
            f,
            h,
            bias=cfg.bias,
            sequence_parallel=sequence_parallel,
            tp_group=tp_group,
            init_method=normal_init(cfg.init_std / math.sqrt(2 * cfg.num_layers)),
            generator=generator(cfg.seed, layer, "mlp_proj"),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.swiglu:
            x = self.fc.enter(x)  # once for both: one collective each way, one saved input
            return self.proj(F.silu(self.gate(x, entered=True)) * self.fc(x, entered=True))
        if self.bias_gelu_fusion:
            y = self.fc(x, add_bias=False)
            # The bias in the activation's dtype, as autocast gives F.linear's bias add.
            return self.proj(bias_gelu(y, self.fc.bias.to(y.dtype)))
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class Block(nn.Module):
    """x + attention(norm(x)), then + mlp(norm(.)), each sub-layer's output dropped out."""

    def __init__(
        self,
        cfg: GPTConfig,
        layer: int,
        tp_group: ProcessGroup | None,
        sequence_parallel: bool,
        rng: RNGStatesTracker | None = None,
        cp_group: ProcessGroup | None = None,
    ) -> None:
        super().__init__()
        self.ln_1 = norm(cfg, sequence_parallel)
        self.attn = Attention(cfg, layer, tp_group, sequence_parallel, rng, cp_group)
        self.ln_2 = norm(cfg, sequence_parallel)
        self.mlp = MLP(cfg, layer, tp_group, sequence_parallel)
        self.drop = nn.Dropout(cfg.hidden_dropout)
        self.fused_norm = cfg.fused_layer_norm

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if not self.fused_norm:
            x = x + self.drop(self.attn(self.ln_1(x), rope, mask))
            return x + self.drop(self.mlp(self.ln_2(x)))
        # The first residual add goes into the second LayerNorm's kernel.
        h = self.drop(self.attn(apply_norm(self.ln_1, x, True), rope, mask))
        ln_2 = self.ln_2
        # fp32 when the stream is, though h (the attention's output) is 16-bit under autocast.
        weight, bias = in_dtype(torch.promote_types(h.dtype, x.dtype), gamma(ln_2), ln_2.bias)
        normed, x = add_layer_norm(h, x, weight, bias, ln_2.eps)
        return x + self.drop(self.mlp(normed))
