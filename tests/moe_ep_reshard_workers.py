"""Workers for tests/test_moe_ep_reshard.py, in launched processes (or, for the merge's
sabotage, in the test's own): an expert-parallel checkpoint resharded on load and saved again,
and one merged with its experts at the wrong global index on purpose."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from typing import Any
from unittest import mock

EXPERT = re.compile(r"(mlp\.experts\.)(\d+)\.")


def shifted(key: str, by: int, num_experts: int) -> str:
    """``key`` with its expert's global index moved ``by`` places (mod num_experts)."""
    return EXPERT.sub(lambda m: f"{m[1]}{(int(m[2]) + by) % num_experts}.", key)


@contextlib.contextmanager
def experts_misplaced() -> Iterator[None]:
    """The merge of an expert-parallel checkpoint's files with every expert moved to the next
    expert-parallel rank's global indices (rank e's experts where rank e + 1's belong): what a
    merge that numbered the experts by file order and took the files in the wrong order would
    do. Their Adam states move with them, so only the placement is wrong."""
    from megart.training import expert_shards, shards

    real = expert_shards.merge_expert_files

    def misplacing(root: Any, pp_rank: int, files: list[dict]) -> dict:
        merged = real(root, pp_rank, files)
        if len(files) == 1:
            return merged
        e = merged["model_config"]["num_experts"]
        by = e // len(files)
        merged["model"] = [{shifted(k, by, e): v for k, v in c.items()} for c in merged["model"]]
        merged["optimizer_params"] = [(c, shifted(k, by, e)) for c, k in merged["optimizer_params"]]
        return merged

    with mock.patch.object(shards, "merge_expert_files", misplacing):
        yield


def train_holding_misplaced(kw: dict) -> dict:
    """train_workers.train_holding under experts_misplaced."""
    import train_workers as tw

    with experts_misplaced():
        return tw.train_holding(kw)


def resharded_and_saved(kw: dict) -> dict:
    """Loads --load's checkpoint into this layout and saves it to --save at the same iteration,
    training nothing; returns the weights held, by place."""
    import train_workers as tw
    from megart.training.data import builtin_corpus
    from megart.training.trainer import Trainer

    trainer = Trainer(tw.tiny(**kw), tokens=builtin_corpus(1 << 16))
    trainer.save_checkpoint(trainer.start_iteration)
    trainer.saves.finish()
    return tw.by_place(trainer, lambda p: p)
