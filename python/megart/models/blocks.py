"""A GPT layer, tensor-parallel: the MLP and the block that joins it to attention (attention.py)
with the norms (norms.py); rotary positions are rope.py's, initial weights init.py's.

Activations are [s, b, h] (sequence first, Megatron's layout): sequence parallelism splits
dimension 0. Each parameter is drawn from a generator seeded by (model seed, layer, name), so a
parameter's initial value does not depend on which stage or rank builds it.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from megart.distributed import ProcessGroup
from megart.kernels import add_layer_norm, bias_gelu
from megart.models.attention import Attention
from megart.models.config import GPTConfig
from megart.models.dropped_output import DroppedOutput
from megart.models.init import generator, weight_init
from megart.models.norms import apply_norm, gamma, in_dtype, norm
from megart.models.recompute import checkpointed
from megart.tensor_parallel import (
    ColumnParallelLinear,
    RNGStatesTracker,
    RowParallelLinear,
)
from megart.tensor_parallel.column_entry import WeightGradSlot, enter_again


class MLP(nn.Module):
    """h -> ffn (column-parallel) -> GeLU, SwiGLU or squared ReLU -> h (row-parallel)."""

    def __init__(
        self, cfg: GPTConfig, layer: int, tp_group: ProcessGroup | None, sequence_parallel: bool
    ) -> None:
        super().__init__()
        h, f = cfg.hidden_size, cfg.ffn_size
        self.swiglu = cfg.activation == "swiglu"
        self.squared_relu = cfg.activation == "squared_relu"
        self.bias_gelu_fusion = cfg.bias_gelu_fusion

        def column(name: str) -> ColumnParallelLinear:
            return ColumnParallelLinear(
                h,
                f,
                bias=cfg.bias,
                sequence_parallel=sequence_parallel,
                tp_group=tp_group,
                # Megatron-Core's fc1 is one tensor, gate and up together under SwiGLU.
                init_method=weight_init(cfg, cfg.init_std, (f * (1 + self.swiglu), h)),
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
            init_method=weight_init(cfg, cfg.init_std / math.sqrt(2 * cfg.num_layers), (h, f)),
            generator=generator(cfg.seed, layer, "mlp_proj"),
        )

    def forward(
        self, x: torch.Tensor, entered: bool = False, slot: WeightGradSlot | None = None
    ) -> torch.Tensor:
        """``entered``: ``x`` and ``slot`` are what ``self.fc.enter`` made of the input."""
        if self.swiglu:
            if not entered:  # once for both: one collective each way, one saved input
                x, slot = self.fc.enter(x)
            gate = self.gate(x, entered=True, slot=slot)
            return self.proj(F.silu(gate) * self.fc(x, entered=True, slot=slot))
        if self.squared_relu:  # Megatron-Core's squared_relu (Nemotron's relu2)
            return self.proj(torch.pow(F.relu(self.fc(x, entered=entered, slot=slot)), 2))
        if self.bias_gelu_fusion:
            y = self.fc(x, add_bias=False, entered=entered, slot=slot)
            # The bias in the activation's dtype, as autocast gives F.linear's bias add.
            return self.proj(bias_gelu(y, self.fc.bias.to(y.dtype)))
        return self.proj(F.gelu(self.fc(x, entered=entered, slot=slot), approximate="tanh"))


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
        self.rng = rng
        # Megatron's --recompute-modules layernorm and mlp (models.recompute.MODULES).
        self.recompute_norms = cfg.recomputes("layernorm")
        self.recompute_mlp = cfg.recomputes("mlp")

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if torch.is_grad_enabled() and (self.recompute_norms or self.recompute_mlp):
            return self._recomputing(x, rope, mask)
        if not self.fused_norm:
            x = x + self.drop(self.attn(self.ln_1(x), rope, mask))
            return x + self.drop(self.mlp(self.ln_2(x)))
        # The first residual add goes into the second LayerNorm's kernel.
        h = self.drop(self.attn(apply_norm(self.ln_1, x, True), rope, mask))
        normed, x = self._add_norm(h, x)
        return x + self.drop(self.mlp(normed))

    def _recomputing(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """forward under --recompute-modules layernorm (the two norms' outputs, and the copies
        the column-parallel products save of them, freed after the products read them and made
        again in backward: DroppedOutput) and/or mlp (the MLP checkpointed from its input, as
        Megatron-Core's tensor_parallel.checkpoint of it): the same operations in the same
        order as forward's, so the same values."""
        attn, mlp, norms = self.attn, self.mlp, self.recompute_norms
        if norms:
            first = DroppedOutput(lambda t: apply_norm(self.ln_1, t, self.fused_norm))
            normed, slot = _entered(first, attn.qkv, first(x))
            a = attn(normed, rope, mask, entered=True, slot=slot)
            first.discard(a)
        else:
            a = attn(apply_norm(self.ln_1, x, self.fused_norm), rope, mask)
        h = self.drop(a)
        second: DroppedOutput | None = None
        if self.fused_norm:  # the first residual add inside the second LayerNorm's kernel
            second = DroppedOutput(self._add_norm) if norms else None
            normed, x = (second or self._add_norm)(h, x)
        else:
            x = x + h
            second = DroppedOutput(self.ln_2) if norms else None
            normed = (second or self.ln_2)(x)
        if self.recompute_mlp:  # the checkpoint keeps the norm's output (freed with layernorm)
            m = checkpointed(mlp, self.rng, normed)
        elif second is not None:
            entered, slot = _entered(second, mlp.fc, normed)
            m = mlp(entered, entered=True, slot=slot)
        else:
            m = mlp(normed)
        if second is not None:
            second.discard(m)
        return x + self.drop(m)

    def _add_norm(self, h: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The fused kernel's (normed, h + x), as forward runs it."""
        ln_2 = self.ln_2
        # fp32 when the stream is, though h (the attention's output) is 16-bit under autocast.
        weight, bias = in_dtype(torch.promote_types(h.dtype, x.dtype), gamma(ln_2), ln_2.bias)
        return add_layer_norm(h, x, weight, bias, ln_2.eps)


def _entered(
    dropped: DroppedOutput, layer: ColumnParallelLinear, normed: torch.Tensor
) -> tuple[torch.Tensor, WeightGradSlot | None]:
    """``layer.enter(normed)``, the copy it makes (gathered, cast) dropped with ``normed``."""
    entered, slot = layer.enter(normed)
    group, sequence = layer.tp_group, layer.sequence_parallel
    dropped.also(entered, lambda n: enter_again(n, entered.dtype, group, sequence))
    return entered, slot
