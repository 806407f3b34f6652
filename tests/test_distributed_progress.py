"""The shm transport's progress thread, with real processes: async ops complete while the rank
that posted them computes, and errors found by the thread reach wait()."""

import progress_workers as w
from megart.launcher import launch


def test_an_async_all_reduce_completes_while_its_poster_sleeps():
    poster, peer = launch(w.big_all_reduce_while_poster_sleeps, 2, timeout=120)
    # Rank 1's synchronous all_reduce needs rank 0's part of every step: it can only finish
    # during rank 0's 3 s sleep if something in rank 0 advanced the op in the meantime.
    assert peer["done"] < poster["woke"]


def test_a_peer_that_dies_while_only_the_thread_waits_fails_the_op():
    result, left = launch(w.peer_dies_while_only_the_thread_waits, 2, timeout=90)
    assert left == "left"
    found, message = result.split("|", 1)
    assert found == "True", "the progress thread should have failed the op before wait()"
    assert "rank 1 (pid" in message and "has exited" in message
    assert "rank 0 of group 'world'" in message and "all_reduce(10 x float32, sum)" in message


def test_a_timeout_found_by_the_thread_raises_at_wait():
    message = launch(w.timeout_while_only_the_thread_waits, 2, timeout=60)[0]
    found, message = message.split("|", 1)
    assert found == "True"
    assert "timed out after 1500 ms waiting for global rank 1" in message
    assert "group 'world'" in message


def test_abort_fails_an_op_that_only_the_thread_waits_on():
    message, status = launch(w.abort_while_only_the_thread_waits, 2, timeout=60)
    assert status == "aborted"
    assert "aborted by rank 1" in message and "recv(4 x float32 from rank 1)" in message


def test_groups_dropped_with_ops_in_flight_shut_down_cleanly():
    assert launch(w.destroy_with_ops_in_flight, 2, timeout=120) == [6, 6]
