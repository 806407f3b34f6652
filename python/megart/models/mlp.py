"""A GPT layer's MLP, tensor-parallel: h -> ffn (column-parallel) -> activation -> h
(row-parallel). models.blocks joins it (or models.moe's experts, each one of these) to
attention; its initial weights are init.py's."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from megart.distributed import ProcessGroup
from megart.kernels import bias_gelu
from megart.models.config import GATED, GPTConfig
from megart.models.init import generator, weight_init
from megart.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megart.tensor_parallel.column_entry import WeightGradSlot, enter_column_region
from megart.tensor_parallel.weight_grad import linear


class MLP(nn.Module):
    """h -> ffn (column-parallel) -> GeLU, SwiGLU, squared ReLU or quick GeGLU -> h
    (row-parallel)."""

    def __init__(
        self,
        cfg: GPTConfig,
        layer: int,
        tp_group: ProcessGroup | None,
        sequence_parallel: bool,
        ffn: int | None = None,
        name: str = "",
        expert: bool = False,
    ) -> None:
        """``ffn``: the width (cfg.ffn_size by default); ``name`` tells apart the initial
        weights of several MLPs in one layer (an MoE layer's experts). ``expert``: an MoE
        layer's expert (Megatron-Core's is_expert), split over ``tp_group`` like this MLP but
        communicating nothing: its input is already every rank's (the layer gathered it, and
        reduce-scatters the input's gradient), and its output is this rank's partial sum
        (the layer sums it)."""
        super().__init__()
        self.expert = expert
        h, f = cfg.hidden_size, ffn or cfg.ffn_size
        self.activation = cfg.activation
        self.swiglu = cfg.activation in GATED  # two first products: linear (fc) and gate
        self.glu_offset, self.clamp = cfg.glu_linear_offset, cfg.activation_func_clamp_value
        self.squared_relu = cfg.activation == "squared_relu"
        self.bias_gelu_fusion = cfg.bias_gelu_fusion

        def column(kind: str) -> ColumnParallelLinear:
            return ColumnParallelLinear(
                h,
                f,
                bias=cfg.bias,
                sequence_parallel=sequence_parallel,
                tp_group=tp_group,
                # Megatron-Core's fc1 is one tensor, gate and up together under SwiGLU.
                init_method=weight_init(cfg, cfg.init_std, (f * (1 + self.swiglu), h)),
                generator=generator(cfg.seed, layer, name + kind),
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
            generator=generator(cfg.seed, layer, name + "mlp_proj"),
        )

    def forward(
        self,
        x: torch.Tensor,
        entered: bool = False,
        slot: WeightGradSlot | None = None,
        scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``entered``: ``x`` and ``slot`` are what ``self.fc.enter`` made of the input.
        ``scale``: a factor per token on the activation before the last product (an expert's
        routing weights, where Megatron-Core's experts apply them)."""
        if self.expert:
            if not entered:  # autocast's cast alone, no collective
                x, slot = enter_column_region(x, None, False)
            y = self._activation(x, True, slot, scale)
            return linear(y, self.proj.weight)  # the row-parallel product, not summed here
        return self.proj(self._activation(x, entered, slot, scale))

    def _activation(
        self,
        x: torch.Tensor,
        entered: bool,
        slot: WeightGradSlot | None,
        scale: torch.Tensor | None,
    ) -> torch.Tensor:
        if self.swiglu:
            if not entered:  # once for both: one collective each way, one saved input
                x, slot = self.fc.enter(x)
            gate = self.gate(x, entered=True, slot=slot)
            y = self.act(self.fc(x, entered=True, slot=slot), gate)
        elif self.bias_gelu_fusion and not self.squared_relu:
            y = self.fc(x, add_bias=False, entered=entered, slot=slot)
            # The bias in the activation's dtype, as autocast gives F.linear's bias add.
            y = bias_gelu(y, self.fc.bias.to(y.dtype))
        else:
            y = self.act(self.fc(x, entered=entered, slot=slot))
        return self.scaled(y, scale)

    def act(self, up: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        """The activation of the first products ``up`` (and a gated unit's ``gate``), their
        biases added (Megatron-Core's unfused path). quick GeGLU (gpt-oss's): Megatron-Core's
        quick_gelu(gate) * (up + offset), the gate clamped above and ``up`` on both sides first."""
        if self.activation == "quick_geglu":
            if self.clamp is not None:
                gate, up = gate.clamp(max=self.clamp), up.clamp(-self.clamp, self.clamp)
            return gate * torch.sigmoid(1.702 * gate) * (up + self.glu_offset)
        if self.swiglu:
            return F.silu(gate) * up
        if self.squared_relu:  # Megatron-Core's squared_relu (Nemotron's relu2)
            return torch.pow(F.relu(up), 2)
        return F.gelu(up, approximate="tanh")

    @staticmethod
    def scaled(y: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        """``y`` times a factor per token (None: as it is), in ``y``'s type."""
        if scale is None:
            return y
        return (y * scale.unsqueeze(-1)).to(y.dtype)
