"""An MoE layer's forward makes the GPU wait for the host a number of times that does not grow
with its experts: the routing map is read with one nonzero (models.expert_exchange.
rows_by_expert), not one per expert, and under expert parallelism the exchange's counts come
back in one read, not one per (rank, expert). Counted on CPU with torch's dispatch (the waits
are the same operations on a GPU; their time is not measured here)."""

import pytest

import moe_sync_workers as sw
from megart.launcher import launch

MODEL = dict(vocab_size=64, seq_length=16, hidden_size=32, num_layers=1, num_attention_heads=4,
             bias=False, moe_aux_loss_coeff=0.01)  # fmt: skip


@pytest.mark.parametrize("ranks", [1, 2], ids=["one-process", "ep2"])
def test_the_waits_do_not_grow_with_the_experts(ranks):
    ep = dict(expert_model_parallel_size=ranks) if ranks > 1 else {}
    waits = {
        e: launch(sw.waits_of_one_forward, ranks, dict(MODEL, num_experts=e, **ep), timeout=300)[
            0
        ]  # fmt: skip
        for e in (4, 16)
    }
    assert waits[4] == waits[16], waits
    assert waits[4].get("aten.nonzero.default") == 1, waits
