"""megart train runs under expert parallelism for tests/test_moe_ep.py, in launched processes:
as they are, or with a deliberate mistake the tests must catch (as moe_workers.train_mistaken
does for context parallelism)."""

from __future__ import annotations


def train_mistaken(kw: dict, mistake: str | None = None) -> list[dict]:
    """The history of a megart train run with flags ``kw``, wrong on purpose where
    ``mistake`` says: "experts-unscaled" (the experts' averaged gradients not scaled by
    edp / dp, so each is ep times the one-process gradient), "experts-norm-local" (the
    gradient norm counting each rank's own experts, not summed over the expert-parallel
    group)."""
    from unittest import mock

    import train_workers as tw
    from megart.training import optimizer

    def unscaled(params, grid, make, real=optimizer.split_buckets):  # noqa: ANN001, ANN202
        return real(params, grid, lambda ps, group, scale=1.0: make(ps, group))

    def local(*args, ep_group=None, real=optimizer.clip_grad_norm):  # noqa: ANN001, ANN202
        return real(*args[:5])

    patches = {
        None: mock.MagicMock(),  # a context manager that changes nothing
        "experts-unscaled": mock.patch.object(optimizer, "split_buckets", unscaled),
        "experts-norm-local": mock.patch.object(optimizer, "clip_grad_norm", local),
    }
    with patches[mistake]:
        return tw.train(**kw)
