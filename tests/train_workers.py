"""The trainer on every rank of a launched job, with a tiny GPT and a small slice of the corpus."""

from __future__ import annotations

from megart.selftest.training import TINY
from megart.training.config import TrainConfig
from megart.training.data import builtin_corpus

# How closely two launches of the same float32 run agree. Not bitwise: on CI's machine two
# identical launches have twice differed by 5e-7 relative at iteration 1, before anything
# differed but the process (one rank once, pp2 once), which 40 launches here, loaded or not,
# never reproduced; MKL documents run-to-run rounding differences (alignment, threading).
# Bugs of resuming (a batch or a learning-rate step late, Adam's moments or the dropout
# streams not restored) move a pp2 loss curve by 7e-4 to 6e-3 relative.
SAME_RUN = dict(rel=1e-5, abs=0)
# For a one-process run whose figures are compared within a few ulps of another computation:
# one intra-op thread. At two (the launcher's share of a 2-core machine), a one-process rank
# under pytest gave, in 8 of 64 runs, a loss 2.2e-6 off (relative) for one forward of a fresh
# GPT: its logits were bit-identical to the other runs', the tokens off were exactly positions
# 8-15 of 16 (the half a second thread takes), up to 3.8e-5 each, and the same loss recomputed
# right after in that process was not off. In 39 runs at one thread, none was. Those ops are
# torch's only (megart's unfused cross-entropy), so the cause lies below megart; seen in
# test_batch_rampup, and likely what put test_megatron_optimizer's moments at position 14 off.
ONE_THREAD = {"OMP_NUM_THREADS": "1"}
MOMENTS = ("exp_avg", "exp_avg_sq")


def tiny(**kw: object) -> TrainConfig:
    base = {**TINY, "clip_grad": 1.0}  # selftest's tiny run (tests of evaluation set eval_iters)
    return TrainConfig(**{**base, **kw})


def train(**kw: object) -> list[dict]:
    from megart.training.trainer import Trainer

    trainer = Trainer(tiny(**kw), tokens=builtin_corpus(1 << 16))
    return trainer.train(quiet=True)


def train_kw(kw: dict) -> list[dict]:
    """``train(**kw)`` in the form launch calls: one positional argument."""
    return train(**kw)


def by_place(trainer: object, tensor_of: object) -> dict:
    """``tensor_of(p)`` for every parameter p this rank holds, gathered over tensor parallelism
    and named as the one-chunk GPT names it (``chunk.blocks.{layer}...``), so layouts can be
    compared. The vocabulary padding, which depends on t, is cut off."""
    import torch

    from megart.models.hf import _gather

    out = {}
    for chunk in trainer.chunks:
        for name, p in chunk.named_parameters():
            if name.startswith("blocks."):
                _, j, rest = name.split(".", 2)
                name = f"blocks.{chunk.layer_ids[int(j)]}.{rest}"
            value = torch.nn.Parameter(tensor_of(p).detach().clone())
            if hasattr(p, "partition_dim"):
                value.partition_dim = p.partition_dim
            full = _gather(value, trainer.grid.tp_group)
            vocab = trainer.model_config.vocab_size
            out["chunk." + name] = full[:vocab] if name == "wte.weight" else full
    return out


def merged_by_place(per_rank: list, key: str) -> dict:
    """One dict of every rank's by-place tensors (``rank[key]``, see held_state); copies held
    twice (data-parallel ranks, the tied embedding of the first and last stage) must be
    equal."""
    import torch

    out = {}
    for rank in per_rank:
        for name, value in rank[key].items():
            assert name not in out or torch.equal(out[name], value), name
            out[name] = value
    return out


def held_state(trainer: object) -> dict:
    """What ``trainer`` holds now: weights and Adam's moments by place (see by_place), the
    steps, the number of parameters with optimizer state, the largest magnitude in the
    vocabulary padding rows of the embedding and its moments (padding must stay zero), and the
    random streams (torch's default CPU generator, the tracker's)."""
    import torch

    # Through the state dict, which both optimizers give in the same form (the distributed one
    # gathers its slices: every rank calls this).
    opt = trainer.optimizer
    params = [p for group in opt.param_groups for p in group["params"]]
    saved = opt.state_dict()["state"]
    state = {id(params[i]): s for i, s in saved.items()}
    out = {"weights": by_place(trainer, lambda p: p), "optimizer_states": len(state)}
    if state:
        for key in ("exp_avg", "exp_avg_sq"):
            out[key] = by_place(trainer, lambda p, key=key: state[id(p)][key])
        out["steps"] = {float(s["step"]) for s in state.values()}
    padding = 0.0
    vocab = trainer.model_config.vocab_size
    for chunk in trainer.chunks:
        if hasattr(chunk, "wte"):
            w = chunk.wte.weight
            start = max(0, vocab - trainer.grid.tp_rank * w.shape[0])
            for t in [w, *state.get(id(w), {}).values()]:
                if t.dim() and start < t.shape[0]:
                    padding = max(padding, float(t.detach()[start:].abs().max()))
    out["padding"] = padding
    out["rng"] = (torch.get_rng_state(), trainer.rng.get_states())
    return out


def train_holding(kw: dict) -> dict:
    """Trains; returns what the trainer held right after it was built (a loaded checkpoint's
    state, see held_state), the iteration figures, and what it held after training."""
    from megart.training.trainer import Trainer

    trainer = Trainer(tiny(**kw), tokens=builtin_corpus(1 << 16))
    loaded = held_state(trainer)
    history = trainer.train(quiet=True)
    return {"loaded": loaded, "history": history, "trained": held_state(trainer)}


def gradients_after_one_step(**kw: object) -> dict:
    """Every gradient this rank holds after one iteration (averaged, summed across the tied
    embedding's copies, clipped), by place (see by_place)."""
    from megart.training.trainer import Trainer

    trainer = Trainer(tiny(train_iters=1, **kw), tokens=builtin_corpus(1 << 16))
    trainer.train(quiet=True)
    return by_place(trainer, lambda p: p.grad)


def initial_weights(kw: dict) -> dict:
    """Every weight this rank holds before training, by place (see by_place)."""
    from megart.training.trainer import Trainer

    return by_place(Trainer(tiny(**kw), tokens=builtin_corpus(1 << 16)), lambda p: p)


def weights_after_training(kw: dict, hf_dir: str | None = None) -> dict:
    """Every weight this rank holds after training, by place (see by_place); with ``hf_dir``
    (one process only) also written there by the live model's GPT.save_hf."""
    from megart.models import GPT
    from megart.training.trainer import Trainer

    trainer = Trainer(tiny(**kw), tokens=builtin_corpus(1 << 16))
    trainer.train(quiet=True)
    if hf_dir is not None:
        model = GPT(trainer.model_config)
        model.chunk.load_state_dict(trainer.chunks[0].state_dict())
        model.save_hf(hf_dir)
    return by_place(trainer, lambda p: p)


def train_crashing_at_second_save(directory: str) -> list[dict]:
    """Saves after iteration 1, then dies while writing the save after iteration 2."""
    import torch

    real_save = torch.save
    calls = []

    def save_or_crash(obj: object, f: object) -> None:
        calls.append(f)
        if len(calls) == 2:
            raise OSError("disk full (simulated)")
        real_save(obj, f)

    torch.save = save_or_crash
    try:
        return train(train_iters=2, save=directory, save_interval=1)
    finally:
        torch.save = real_save


def train_on(data_path: str | list[str], vocab_size: int) -> list[dict]:
    from megart.training.trainer import Trainer

    return Trainer(tiny(data_path=data_path, vocab_size=vocab_size, train_iters=2)).train(
        quiet=True
    )


def train_tracking_weights(kw: dict) -> list[dict]:
    """Each iteration's figures plus a checksum of this rank's weights after it."""
    import torch

    from megart.training.trainer import Trainer

    trainer = Trainer(tiny(**kw), tokens=builtin_corpus(1 << 16))
    out = []
    for fig in trainer.iterations():
        with torch.no_grad():
            fig["weights"] = sum(
                float(p.double().sum()) for c in trainer.chunks for p in c.parameters()
            )
        out.append(fig)
    return out


def evaluation_against_the_whole_model(kw: dict) -> list[tuple[float, float]]:
    """For the validation and the test range: (Trainer.evaluate() before any step, the same
    batches' mean loss from one GPT module called directly, dropout off), the pipeline
    engine's forward-only pass against no engine."""
    import torch

    from megart.models import GPT
    from megart.training.trainer import Trainer

    trainer = Trainer(tiny(**kw), tokens=builtin_corpus(1 << 16))
    c = trainer.config
    model = GPT(trainer.model_config).eval()
    pairs = []
    for data in (trainer.valid, trainer.test):
        losses = []
        with torch.no_grad():
            for i in range(c.eval_iters):
                inputs, targets = data.global_batch(c.seed, i, c.global_batch_size)
                for x, y in zip(
                    inputs.split(c.micro_batch_size),
                    targets.split(c.micro_batch_size),
                    strict=True,
                ):
                    losses.append(model(x, y).item())
        pairs.append((trainer.evaluate(data), sum(losses) / len(losses)))
    return pairs


def loaded_and_first_step(kw: dict) -> tuple[dict, list[dict], tuple]:
    """(the weights right after --load, by place; the figures of each iteration run; the
    global batch of iteration 0, which the first iteration trains on)."""
    from megart.training.trainer import Trainer

    trainer = Trainer(tiny(**kw), tokens=builtin_corpus(1 << 16))
    loaded = by_place(trainer, lambda p: p)
    c = trainer.config
    batch = trainer.data.global_batch(c.seed, trainer.start_iteration, c.global_batch_size)
    return loaded, trainer.train(quiet=True), batch


def rewrite_checkpoint_file(path, change) -> None:
    """Loads one checkpoint file, applies ``change`` to its state and saves it again with a new
    checksum (as a tool that edits checkpoints on purpose would; corruption is tested apart)."""
    import torch

    from megart.training import checksum

    state = torch.load(path, weights_only=False)
    change(state)
    torch.save(state, path)
    checksum.write(path)


def assert_resumed_on_curve(straight: list, resumed: list, **tolerance: float) -> None:
    """The run resumed after iteration 2 (``resumed``: its ranks' train_holding results)
    trained iterations 3 and 4 with the uninterrupted run's losses (``straight``: its
    history) within ``tolerance`` (pytest.approx's)."""
    import pytest

    history = resumed[0]["history"]
    assert [h["iteration"] for h in history] == [3, 4]
    want = [h["loss"] for h in straight[2:]]
    assert [h["loss"] for h in history] == pytest.approx(want, **tolerance)


def assert_holds(trained: list, resumed: list, keys: tuple = ("weights", *MOMENTS)) -> list:
    """The resumed ranks held, right after loading, exactly what the saving ranks held
    (``trained``: their held_state), for each of ``keys``, whatever either layout; returns
    what the resumed ranks held."""
    import torch

    loaded = [r["loaded"] for r in resumed]
    for key in keys:
        want, got = merged_by_place(trained, key), merged_by_place(loaded, key)
        assert set(got) == set(want), key
        assert all(torch.equal(got[n], want[n]) for n in want), key
    return loaded


def holding(nproc: int, kw: dict) -> list[dict]:
    """train_holding on ``nproc`` launched ranks (each rank's result)."""
    from megart.launcher import launch

    return launch(train_holding, nproc, kw, timeout=300)


def saved_and_resumed(n_save: int, save: dict, n_run: int, run: dict, store: object) -> tuple:
    """A 4-iteration run on ``n_save`` ranks (flags ``save``) that saves into ``store`` and
    stops after iteration 2, then one resumed from it on ``n_run`` ranks (``run``): what the
    saving ranks held at the save (held_state), and the resumed ranks' train_holding."""
    saving = holding(n_save, dict(save, train_iters=4, exit_interval=2, save=str(store)))
    resumed = holding(n_run, dict(run, train_iters=4, load=str(store)))
    return [r["trained"] for r in saving], resumed


def gathered_dtypes(kw: dict) -> list[str]:
    """The dtypes sequence parallelism's column entries gather over one training iteration
    (megart.tensor_parallel.column_entry's all-gathers, in order)."""
    from megart.tensor_parallel import column_entry

    seen, gather = [], column_entry._all_gather

    def recording(x, dim, group):  # noqa: ANN001, ANN202 (the wrapped function's own)
        seen.append(str(x.dtype))
        return gather(x, dim, group)

    column_entry._all_gather = recording
    try:
        train(train_iters=1, **kw)
    finally:
        column_entry._all_gather = gather
    return seen
