"""Multi-latent attention's optimizer state in Megatron-LM's formats against Megatron-Core
0.16.1's own DistributedOptimizer over its MLA model (test_megatron_mla_ckpt has the weights):
it loads megart's distrib_optim.pt (--ckpt-format torch) and torch_dist store, holding
megart's fp32 weights and Adam moments piece by piece, and megart resumes what it writes."""

import pytest

import megatron_distopt_checks as checks
from test_mla import TRAIN

pytest.importorskip("megatron.core")
pytest.importorskip("psutil")  # Megatron-Core's torch_dist writer needs it


def _losses(history: list[dict]) -> list[float]:
    return [h["loss"] for h in history]


def test_megatron_cores_distributed_optimizer_loads_megarts_mla_distrib_optim(tmp_path):
    """tp2 x dp2 --use-distributed-optimizer --ckpt-format torch: Megatron-Core's own
    DistributedDataParallel and DistributedOptimizer over its MLA model hold megart's state
    (its buffers in MLA's parameter order, kv_down_proj among them); megart resumes what it
    writes on the uninterrupted curve."""
    checks.check_distrib_optim(tmp_path, TRAIN, "kv_down_proj", _losses)


def test_megatron_cores_distributed_optimizer_loads_megarts_mla_torch_dist_store(tmp_path):
    """tp2 x dp2 --ckpt-format torch_dist --use-distributed-optimizer: Megatron-Core's
    DistributedOptimizer over its MLA model holds megart's store bitwise, linear_kv_down_proj
    among its pieces; megart resumes what it saves on the curve."""
    checks.check_torch_dist_store(tmp_path, TRAIN, "linear_kv_down_proj")
