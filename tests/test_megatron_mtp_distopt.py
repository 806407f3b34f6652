"""Multi-token prediction's optimizer state in Megatron-LM's formats against Megatron-Core
0.16.1's own DistributedOptimizer over its GPTModel with depths (test_megatron_mtp_ckpt has
the weights and its non-distributed optimizer): it loads megart's distrib_optim.pt
(--ckpt-format torch) and torch_dist store, holding megart's fp32 weights and Adam moments
piece by piece (the depths' in its buffers' order), and megart resumes what it writes on the
uninterrupted curve of the main and depth losses."""

import pytest

import megatron_distopt_checks as checks
import mtp_workers as mw
from test_megatron_mtp_ckpt import NAMES, TRAIN

pytest.importorskip("megatron.core")
pytest.importorskip("psutil")  # Megatron-Core's torch_dist writer needs it


def _losses(history: list[dict]) -> list[float]:
    return mw.curve(history, NAMES)


def test_megatron_cores_distributed_optimizer_loads_megarts_mtp_distrib_optim(tmp_path):
    """tp2 x dp2 --use-distributed-optimizer --ckpt-format torch: Megatron-Core's own
    DistributedDataParallel and DistributedOptimizer over its MTP model hold megart's state
    (its buffers in the depths' parameter order, mtp.layers.1.eh_proj among them); megart
    resumes what it writes on the uninterrupted curve of the main and depth losses."""
    checks.check_distrib_optim(tmp_path, TRAIN, "mtp.layers.1.eh_proj", _losses)


def test_megatron_cores_distributed_optimizer_loads_megarts_mtp_torch_dist_store(tmp_path):
    """tp2 x dp2 --ckpt-format torch_dist --use-distributed-optimizer: Megatron-Core's
    DistributedOptimizer over its MTP model holds megart's store bitwise, the depths' eh_proj
    among its pieces; megart resumes what it saves on the curve."""
    checks.check_torch_dist_store(tmp_path, TRAIN, "mtp.layers.1.eh_proj")
