"""--distributed-backend torch: every tested layout trains on the one-process loss curve with
megart's communication delegated to torch.distributed (gloo), an implementation independent of
megart's transports."""

import pytest

import train_workers as tw
from megart.launcher import launch
from test_trainer import same_curve

LAYOUTS = {
    "tp2": (2, dict(tensor_model_parallel_size=2)),
    "pp2": (2, dict(pipeline_model_parallel_size=2)),
    "dp2": (2, {}),
    "tp2-pp2": (4, dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)),
}


@pytest.fixture(scope="module")
def reference():
    return launch(tw.train, 1, timeout=300)[0]


def _train_over_torch(kw):
    import torch.distributed as td

    history = tw.train(distributed_backend="torch", **kw)
    assert td.is_initialized() and td.get_backend() == "gloo"  # it did go through torch
    return history


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_over_torch_follows_the_single_process_loss_curve(name, reference):
    nproc, kw = LAYOUTS[name]
    for history in launch(_train_over_torch, nproc, kw, timeout=300):
        same_curve(history, reference)
