"""A GPT layer, tensor-parallel: the block that joins attention (attention.py) to the MLP
(mlp.py, or moe.py's mixture of experts) with the norms (norms.py); rotary positions are
rope.py's.

Activations are [s, b, h] (sequence first, Megatron's layout): sequence parallelism splits
dimension 0. Each parameter is drawn from a generator seeded by (model seed, layer, name), so a
parameter's initial value does not depend on which stage or rank builds it.
"""

from __future__ import annotations

import torch
from torch import nn

from megart.distributed import ProcessGroup
from megart.kernels import add_layer_norm
from megart.models.attention import Attention
from megart.models.config import GPTConfig
from megart.models.dropped_output import DroppedOutput
from megart.models.mla import MLA
from megart.models.mlp import MLP
from megart.models.moe import AuxLossScale, MoE
from megart.models.norms import apply_norm, gamma, in_dtype, norm
from megart.models.recompute import checkpointed
from megart.tensor_parallel import ColumnParallelLinear, RNGStatesTracker
from megart.tensor_parallel.column_entry import WeightGradSlot, enter_again


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
        loss_scale: AuxLossScale | None = None,
        ep_group: ProcessGroup | None = None,
    ) -> None:
        """``loss_scale``: the factor of an MoE layer's auxiliary losses' gradients (the
        chunk's; models.moe); ``ep_group``: the group its experts are spread over."""
        super().__init__()
        self.ln_1 = norm(cfg, sequence_parallel)
        kind = MLA if cfg.multi_latent_attention else Attention
        self.attn = kind(cfg, layer, tp_group, sequence_parallel, rng, cp_group)
        self.ln_2 = norm(cfg, sequence_parallel)
        moe = cfg.is_moe_layer(layer)
        self.mlp: nn.Module = (
            MoE(
                cfg,
                layer,
                loss_scale or AuxLossScale(),
                tp_group,
                sequence_parallel,
                cp_group,
                ep_group,
            )
            if moe
            else MLP(cfg, layer, tp_group, sequence_parallel)
        )
        self.drop = nn.Dropout(cfg.hidden_dropout)
        self.fused_norm = cfg.fused_layer_norm
        self.rng = rng
        # Megatron's --recompute-modules layernorm and mlp (models.recompute.MODULES).
        self.recompute_norms = cfg.recomputes("layernorm")
        # As in Megatron-Core, "mlp" checkpoints dense MLPs only, "moe" whole MoE layers.
        self.recompute_mlp = cfg.recomputes("moe" if moe else "mlp")

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
        again in backward: DroppedOutput) and/or mlp or moe (the MLP or MoE layer checkpointed
        from its input, as Megatron-Core's tensor_parallel.checkpoint of it): the same
        operations in the same order as forward's, so the same values."""
        attn, mlp, norms = self.attn, self.mlp, self.recompute_norms
        if norms:
            first = DroppedOutput(lambda t: apply_norm(self.ln_1, t, self.fused_norm))
            normed, slot = _entered(first, attn.entry, first(x))
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
