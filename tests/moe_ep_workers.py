"""megart train runs under expert parallelism for tests/test_moe_ep.py and
tests/test_moe_ep_distopt.py, in launched processes; the model they and the other expert-
parallel tests train: as they are, or with a deliberate mistake
the tests must catch (as moe_workers.train_mistaken does for context parallelism); and the
checks of their histories against the one-process curve."""

from __future__ import annotations

# The mixture-of-experts model the expert-parallel tests train (tests/test_moe_ep*.py,
# test_moe.py), both auxiliary losses on; conftest.moe_one_process is its one-process curve.
MODEL = dict(num_experts=4, disable_bias_linear=True, moe_aux_loss_coeff=0.1,
             moe_z_loss_coeff=0.01)  # fmt: skip
TRAIN = dict(MODEL, train_iters=4)


def train_mistaken(kw: dict, mistake: str | None = None) -> list[dict]:
    """The history of a megart train run with flags ``kw``, wrong on purpose where
    ``mistake`` says: "experts-unscaled" (the experts' averaged gradients not scaled by
    edp / dp, so each is ep times the one-process gradient), "experts-norm-local" (the
    gradient norm counting each rank's own experts, not summed over the expert-parallel
    group), "experts-sharded-over-dp" (the experts' buckets reduced, and with the distributed
    optimizer sharded and gathered, over data parallelism instead of their expert-data-parallel
    group), "experts-sliced-as-dense" (the distributed optimizer taking the dense buckets'
    slices and group for the experts' buckets too), "experts-stats-local" (--log-params-norm
    and --log-num-zeros-in-grad counting each rank's own experts only); under tensor or context
    parallelism as well (test_moe_ep_tp.py): "experts-output-sliced" (the exchanged experts'
    outputs cut to this rank's slice of the sequence without their sum over the tensor-parallel
    group, as when the exchange returned before the reduce-scatter), "experts-scaled-over-dp"
    (the experts' averages scaled by edp / dp, not edp / (dp x cp)), "experts-norm-tp-rank-0"
    (the norm counting the experts' tensor-parallel shards on tensor-parallel rank 0 only, as
    replicas)."""
    from collections.abc import Iterator
    from contextlib import contextmanager
    from unittest import mock

    import train_workers as tw
    from megart.models import moe
    from megart.tensor_parallel import scatter_to_sequence_region
    from megart.training import expert_grads, grad_norm, iteration_stats, optimizer

    def unscaled(params, grid, make, real=optimizer.split_buckets):  # noqa: ANN001, ANN202
        return real(params, grid, lambda ps, group, scale=1.0: make(ps, group))

    def local(*args, ep_group=None, real=optimizer.clip_grad_norm):  # noqa: ANN001, ANN202
        return real(*args[:5])

    def over_dp(params, grid, make, real=optimizer.split_buckets):  # noqa: ANN001, ANN202
        return real(
            params, grid, lambda ps, group, scale=1.0: make(ps, grid.dp_cp_group, scale=scale)
        )

    def as_dense(self, bucket):  # noqa: ANN001, ANN202
        return self.sets[0]

    def stats_local(chunks, grid, opt, real=iteration_stats._counted):  # noqa: ANN001, ANN202
        dense, experts, group = real(chunks, grid, opt)
        return dense + (experts or []), None, group

    def scaled_over_dp(params, grid, make, real=optimizer.split_buckets):  # noqa: ANN001, ANN202
        def made(ps, group, scale=None):  # noqa: ANN001, ANN202 (scale given for experts only)
            cp = grid.layout.cp
            return make(ps, group) if scale is None else make(ps, group, scale=scale * cp)

        return real(params, grid, made)

    def tp_rank_0(chunk, name, p, tp_rank, real=grad_norm.counted_in_norm):  # noqa: ANN001, ANN202
        shard = expert_grads.is_expert(p) and tp_rank != 0
        return not shard and real(chunk, name, p, tp_rank)

    @contextmanager
    def norm_patches() -> Iterator[None]:  # the norm's rule where both optimizers ask it
        with mock.patch.object(grad_norm, "counted_in_norm", tp_rank_0):
            with mock.patch.object(optimizer, "counted_in_norm", tp_rank_0):
                yield

    patches = {
        None: mock.MagicMock(),  # a context manager that changes nothing
        "experts-unscaled": mock.patch.object(optimizer, "split_buckets", unscaled),
        "experts-norm-local": mock.patch.object(optimizer, "clip_grad_norm", local),
        "experts-sharded-over-dp": mock.patch.object(optimizer, "split_buckets", over_dp),
        "experts-sliced-as-dense": mock.patch.object(expert_grads.SplitBuckets, "owner", as_dense),
        "experts-stats-local": mock.patch.object(iteration_stats, "_counted", stats_local),
        "experts-output-sliced": mock.patch.object(
            moe, "reduce_scatter_to_sequence_region", scatter_to_sequence_region
        ),
        "experts-scaled-over-dp": mock.patch.object(optimizer, "split_buckets", scaled_over_dp),
        "experts-norm-tp-rank-0": norm_patches(),
    }
    with patches[mistake]:
        return tw.train(**kw)


# The auxiliary losses every MoE run logs, compared along the curve with the loss and the norm.
LOGGED = ("load_balancing_loss", "z_loss")


def launched(runs: dict) -> dict:
    """Each of ``runs`` (name: (processes, flags, train_mistaken's mistake or None, the rank
    whose history to read)) launched: that rank's history, by name."""
    from megart.launcher import launch

    return {
        name: launch(train_mistaken, n, kw, mistake, timeout=300)[rank]
        for name, (n, kw, mistake, rank) in runs.items()
    }


def assert_on_curve(one_process: list[dict], run: list[dict]) -> None:
    """``run`` has the loss, the clipped gradient's norm and the logged auxiliary losses of
    the one-process run (the tiny runs clip at 1.0, below the norm of every iteration: so the
    clip acts on every step)."""
    import pytest

    from train_workers import SAME_RUN

    for key in ("loss", "grad_norm", *LOGGED):
        want = [h[key] for h in one_process]
        assert [h[key] for h in run] == pytest.approx(want, **SAME_RUN), key
    assert all(h["grad_norm"] > 1.0 for h in one_process)


def assert_off_curve(one_process: list[dict], run: list[dict]) -> None:
    """``run``'s gradient norm leaves the one-process curve from the first step, its loss from
    the second on (the first step's loss precedes any update)."""
    import pytest

    from train_workers import SAME_RUN

    for key, after in (("grad_norm", 0), ("loss", 1)):
        want = [h[key] for h in one_process][after:]
        assert [h[key] for h in run][after:] != pytest.approx(want, **SAME_RUN), key
