"""Multi-token prediction with mixture-of-experts models (tests/test_mtp_moe*.py): the comparison
with Megatron-Core of tests/mtp_workers.py, made on purpose with a mistake the tests must catch;
run in a launched process, since the mistakes patch megart's classes for that process."""

from __future__ import annotations

from unittest import mock

import mtp_workers as mw
from megart.models import GPTConfig
from megart.models.moe import MoE, _SeedGradient
from megart.models.moe_checks import is_moe_layer


def _depths_dense(cfg: GPTConfig, layer: int) -> bool:
    """The depths' layers always dense (what megart built before it took MoE depths)."""
    return layer < cfg.num_layers and is_moe_layer(cfg, layer)


def _depths_by_number(cfg: GPTConfig, layer: int) -> bool:
    """The depths' layers MoE by their own numbers under --moe-layer-freq N (not the last
    decoder layer's kind, as Megatron-Core builds them)."""
    return layer % cfg.moe_layer_freq == 0


def _scaled_attach(self: MoE, x, loss, name, coeff):  # noqa: ANN001, ANN202 (MoE._attach's)
    """MoE._attach, the depths' auxiliary losses scaled by the depths' loss factor as well."""
    factor = self.cp
    if self.layer >= self.cfg.num_layers:
        factor *= self.cfg.mtp_loss_scaling_factor / self.cfg.mtp_num_layers
    return _SeedGradient.apply(x, loss, self.loss_scale, factor, name, coeff, self.layer)


MISTAKES = {
    "depths-dense": (GPTConfig, "is_moe_layer", _depths_dense),
    "depths-by-number": (GPTConfig, "is_moe_layer", _depths_by_number),
    "depth-aux-scaled": (MoE, "_attach", _scaled_attach),
}


def compare_mistaken(kw: dict, mistake: str) -> dict:
    """mtp_workers.compare_mtp of ``kw`` with ``mistake`` (a MISTAKES key) in megart's model;
    where Megatron-Core's model refuses megart's weights (other layers), the refusal's text."""
    owner, name, wrong = MISTAKES[mistake]
    with mock.patch.object(owner, name, wrong):
        try:
            return mw.compare_mtp(kw)
        except RuntimeError as e:  # its strict load
            return {"refused": str(e)}


def trained_without_depth_biases(kw: dict) -> list[dict]:
    """megart train's history with flags ``kw`` (a --load of a checkpoint with expert biases),
    the depths' routers' biases left at zero on load (the decoder's loaded)."""
    import train_workers as tw
    from megart.training import checkpoint

    real = checkpoint.load_expert_bias

    def decoders_only(chunks, rows):  # noqa: ANN001, ANN202 (load_expert_bias's)
        rows = rows.clone()
        rows[chunks[0].cfg.num_layers :] = 0
        real(chunks, rows)

    with mock.patch.object(checkpoint, "load_expert_bias", decoders_only):
        return tw.train(**kw)
