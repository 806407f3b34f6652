"""Dropout streams: distinct per tensor-parallel rank inside regions, shared outside, and the
default stream undisturbed by forks."""

import pytest
import torch
import torch.nn.functional as F

import megart.tensor_parallel as tp
from megart import ConfigError


@pytest.fixture(autouse=True)
def keep_torch_rng():
    saved = torch.get_rng_state()
    yield
    torch.set_rng_state(saved)


def _rank_masks(seed: int, tp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What rank ``tp_rank`` of a group draws: a mask inside a region, then one outside."""
    tracker = tp.RNGStatesTracker()
    tp.seed_tensor_parallel(tracker, seed, tp_rank)
    ones = torch.ones(64)
    with tp.fork(tracker):
        inside = F.dropout(ones, 0.5)
    return inside, F.dropout(ones, 0.5)


def test_regions_differ_across_ranks_and_replicated_work_agrees():
    masks = [_rank_masks(seed=5, tp_rank=r) for r in range(4)]
    insides = [m[0] for m in masks]
    assert all(not torch.equal(insides[0], x) for x in insides[1:])
    assert all(torch.equal(masks[0][1], m[1]) for m in masks[1:])
    # Reproducible: the same seed and rank give the same masks.
    assert all(torch.equal(a, b) for a, b in zip(_rank_masks(5, 2), masks[2], strict=True))


def test_a_fork_leaves_the_default_stream_where_it_was():
    torch.manual_seed(0)
    expected = torch.rand(5)
    torch.manual_seed(0)
    tracker = tp.RNGStatesTracker()
    tracker.add("tensor-parallel", 123)
    first = torch.rand(2)
    with tp.fork(tracker):
        torch.rand(100)
    assert torch.equal(torch.cat([first, torch.rand(3)]), expected)


def test_forks_continue_their_stream_and_states_round_trip():
    tracker = tp.RNGStatesTracker()
    tracker.add("tensor-parallel", 9)
    stream = torch.Generator().manual_seed(9)
    with tp.fork(tracker):
        a = torch.rand(3)
    saved = tracker.get_states()
    with tp.fork(tracker):
        b = torch.rand(3)
    assert torch.equal(torch.cat([a, b]), torch.rand(6, generator=stream))
    tracker.set_states(saved)
    with tp.fork(tracker):
        assert torch.equal(torch.rand(3), b)


def test_unknown_and_duplicate_streams_are_errors():
    tracker = tp.RNGStatesTracker()
    with pytest.raises(ConfigError, match="'tensor-parallel' does not exist"):
        with tp.fork(tracker):
            pass
    tracker.add("x", 1)
    with pytest.raises(ConfigError, match="'x' already exists"):
        tracker.add("x", 2)
    assert tracker.names() == ["x"]


def test_generator_states_round_trip_and_skip_a_cuda_state_without_a_gpu(monkeypatch):
    """What checkpoints save of torch's default generators: installing a capture replays the
    same draws, and a GPU run's CUDA state is ignored where there is no GPU (resume on CPU)."""
    torch.manual_seed(4)
    saved = tp.GeneratorStates.current()
    expected = torch.rand(5)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    called = []
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda *a: called.append(a))
    tp.GeneratorStates(saved.cpu, torch.zeros(16, dtype=torch.uint8)).install()
    assert torch.equal(torch.rand(5), expected)
    assert called == []
