"""Megatron-LM's choices of how its MoE layer moves tokens and runs its experts, which leave
the layer's math unchanged: megart takes each (TrainConfig's fields of the same names) and
computes what Megatron-Core computes with it.

- --moe-token-dispatcher-type allgather (Megatron's default) or alltoall: two ways of getting
  each token to its experts and back, with the same outputs and gradients
  (tests/test_moe_ep_tp.py compares megart's layer with Megatron-Core's dispatchers of both
  kinds). megart's layer does the same either way: under tensor parallelism (with
  --sequence-parallel) it gathers the sequence as the allgather dispatcher does and
  reduce-scatters the summed output; under expert parallelism it sends each (token, expert)
  copy to the expert's owner all-to-all, as the alltoall dispatcher does
  (models.expert_exchange). flex (DeepEP's or HybridEP's fused all-to-all kernels) is refused:
  megart has neither.
- --moe-permute-fusion and --moe-router-fusion: Transformer Engine's fused kernels for sorting
  tokens by expert, and for the router's top-k and auxiliary-loss statistics; the same math,
  so accepted; megart runs its own unfused torch ops either way.
- --moe-grouped-gemm: Megatron-Core's experts as one grouped matrix product per projection
  (GroupedMLP, TEGroupedMLP) rather than one product per expert (SequentialMLP): megart does
  the same with it (models.moe_grouped: each projection's weights of a layer's local experts
  packed into one stack, the tokens sorted by expert, torch._grouped_mm or, where torch does
  not compute it, a loop over the stack's slices), with the outputs and gradients of its
  per-expert loop. The experts keep their per-expert parameters and names, so every
  checkpoint format writes the files it writes without the flag (each expert's weight over
  its own bytes: training.compact_tensors), --ckpt-format torch and torch_dist included:
  Megatron-Core's SequentialMLP files (their args record moe_grouped_gemm False), which its
  own MoE model loads strictly (tests/test_moe_grouped_ckpt.py), and a run resumes with the
  flag turned either way. Megatron-LM's files of grouped experts (GroupedMLP's
  weight1/weight2, TEGroupedMLP's linear_fc1.weight0...) are not written, and are refused
  where read (megatron_args.MOE_UNBUILT): Megatron-Core's grouped experts need the
  grouped_gemm package or Transformer Engine, so megart cannot check such files here.
"""

from __future__ import annotations

from typing import Any

from megart.errors import ConfigError

DISPATCHERS = ("allgather", "alltoall")


def check_moe_kernels(cfg: Any) -> None:
    """Refuses the MoE kernel and dispatch choices megart cannot honour, by name."""
    kind = cfg.moe_token_dispatcher_type
    if kind == "flex":
        raise ConfigError(
            "--moe-token-dispatcher-type flex: Megatron-Core's flex dispatcher runs DeepEP's or "
            "HybridEP's fused all-to-all kernels, which megart does not have; use allgather or "
            "alltoall (megart computes the same layer with either)"
        )
    if kind not in DISPATCHERS:
        raise ConfigError(
            f"--moe-token-dispatcher-type {kind!r}: give one of {', '.join(DISPATCHERS)}"
        )
