"""batch_isend_irecv's one-call path on the shm transport (a one-process world: sends to self)
declines whatever the checked path must explain or handle, and its Works behave as Works."""

import pytest
import torch

import megart.distributed as dist
from megart import ConfigError


@pytest.fixture
def one_process_world():
    dist.init(backend="shm")
    yield
    dist.destroy()


def _exchange(x, y, group=None, recv_group=None):
    return dist.batch_isend_irecv(
        [dist.P2POp(dist.isend, x, 0, group), dist.P2POp(dist.irecv, y, 0, recv_group)]
    )


def test_the_fast_path_returns_works_that_hold_their_tensors(one_process_world):
    x, y = torch.arange(5.0), torch.empty(5)
    works = _exchange(x, y)
    assert all(isinstance(w, dist.Work) for w in works)
    assert all(w.wait() for w in works)
    assert torch.equal(x, y) and works[1].is_completed()
    works = _exchange(x, y)
    for w in works:
        w.wait_stream()  # host memory: waits
    assert dist.bytes_sent() == {0: 40}


def test_bad_ops_get_the_checked_paths_errors_before_anything_is_sent(one_process_world):
    y = torch.empty(4)
    with pytest.raises(ConfigError, match="not contiguous"):
        _exchange(torch.ones(2, 2).t(), y)
    with pytest.raises(ConfigError, match="complex64 cannot be communicated"):
        _exchange(torch.ones(4, dtype=torch.complex64), y)
    with pytest.raises(ConfigError, match="expected a torch.Tensor, got list"):
        _exchange([1.0], y)
    with pytest.raises(ConfigError, match="rank 1 is not in group 'world'"):
        dist.batch_isend_irecv([dist.P2POp(dist.isend, y, 1)])
    assert dist.bytes_sent() == {0: 0}  # nothing was sent by the refused batches


def test_a_batch_over_two_groups_takes_the_checked_path(one_process_world):
    g = dist.new_group([0])
    x, y = torch.arange(3.0), torch.empty(3)
    for w in _exchange(x, y, group=g, recv_group=g):  # the group's own batcher
        w.wait()
    assert torch.equal(x, y)
    y.zero_()
    a, b = torch.ones(2), torch.empty(2)
    works = dist.batch_isend_irecv(
        [
            dist.P2POp(dist.isend, x, 0, g),
            dist.P2POp(dist.isend, a, 0),
            dist.P2POp(dist.irecv, b, 0),
            dist.P2POp(dist.irecv, y, 0, g),
        ]
    )
    for w in works:
        w.wait()
    assert torch.equal(x, y) and torch.equal(a, b)
