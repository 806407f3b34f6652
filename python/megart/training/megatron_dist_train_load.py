"""--load of a torch_dist store (Megatron-LM's, or megart train's --ckpt-format torch_dist:
megart.training.megatron_dist_train says what it holds) into any tensor/pipeline layout: each
rank reads its slices of the weights and, as the flags ask, of the optimizer's state and its
random streams.

The non-distributed optimizer's moments (and fp32 main weights) are read here, under the
model's keys; the distributed optimizer's buckets through megart.training.megatron_dist_distopt
(the saved tensor/pipeline layout) or its reshard index (any other). What the store lacks for
this model is refused with the flags that load less of it (--finetune, --no-load-optim,
--no-load-rng).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from megart.errors import ConfigError
from megart.tensor_parallel.random import GeneratorStates
from megart.training import dist_store
from megart.training import megatron_dist_distopt as distopt
from megart.training.dist_store import Pieces, PiecesPlanner
from megart.training.host_random import install_host_generators
from megart.training.megatron_dist import load_store, stored
from megart.training.megatron_dist_distopt_reshard import read_resharded, saved_ep
from megart.training.megatron_dist_places import VOCAB_KEYS, Place, bias_places, places
from megart.training.megatron_dist_train import FP32, MOMENTS, moment_key, rng_key
from megart.training.megatron_files import from_grad_scaler
from megart.training.megatron_mla import te_key
from megart.training.megatron_scheduler import check_scheduler


def _foreign(root: Path, problem: str) -> ConfigError:
    return ConfigError(
        f"{root}: {problem}: its optimizer state is not the non-distributed optimizer's of "
        "this model (Megatron-LM's --use-distributed-optimizer keys it otherwise); add "
        "--finetune (its weights, from iteration 0) or --no-load-optim (its weights and "
        "iteration, a fresh optimizer)"
    )


# A LayerNorm's bias (the final norm's, --qk-layernorm's, Transformer Engine's fused ones).
NORM_BIAS = re.compile(r"(layernorm\.bias|layer_norm_bias)$")


def _older_norms(root: Path, key: str) -> ConfigError:
    """An older megart's store of LayerNorm with --disable-bias-linear: it built the norms
    without their bias (megart.training.norm_biases), which a torch_dist load does not fill."""
    return ConfigError(
        f"{root}: the store holds no {key}: an older megart saved it, whose LayerNorm had no "
        "bias under --disable-bias-linear (Megatron-Core's and now megart's keeps it); convert "
        "it with 'megart convert-checkpoint --from megatron --to megart --load DIR --save OUT' "
        "and --load OUT (its weights with zero norm biases, from iteration 0), or resume it "
        "with the megart that saved it"
    )


class _Reads:
    """The slices this rank reads, per key, checked against the store."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.meta = stored(root)
        self.wanted: dict[str, Pieces] = {}
        self.copies: list[tuple[torch.Tensor, torch.Tensor]] = []

    def add(self, key: str, place: Place, tensor: torch.Tensor) -> None:
        meta = self.meta.get(key)
        vocab = place.key in VOCAB_KEYS
        if not isinstance(meta, dcp.metadata.TensorStorageMetadata):
            problem = f"the store holds no {key}"
        elif tuple(meta.size)[vocab:] != tuple(place.size)[vocab:]:
            problem = f"{key} has shape {list(meta.size)}, this model's {list(place.size)}"
        else:
            problem = None
        if problem is not None and meta is None and NORM_BIAS.search(key):
            raise _older_norms(self.root, key)
        if problem is not None and meta is None and te_key(key) in self.meta:
            raise ConfigError(
                f"{self.root}: a store of Transformer Engine's layer spec (multi-latent "
                f"attention's norm under {te_key(key)}, not {key}): megart train reads MLA's "
                "stores of the local spec (Megatron-LM's --transformer-impl local); "
                "megart convert-checkpoint --from megatron --to megart reads this one"
            )
        if problem is not None and key.startswith("optimizer."):
            raise _foreign(self.root, problem)
        if problem is not None:
            raise ConfigError(f"{self.root}: {problem}; resume with the flags of its model")
        offsets, piece = place.offsets, place.piece(tensor)
        if vocab:  # rows past the stored padding stay zero (megart.models.vocab.fit_vocab)
            rows = max(0, min(piece.shape[0], meta.size[0] - offsets[0]))
            piece[rows:].zero_()
            piece = piece[:rows]
        if not piece.numel():
            return
        dist_store.check_covered(key, meta, offsets, piece.shape, self.root)
        pieces = self.wanted.setdefault(key, Pieces(meta.size))
        same = pieces.pieces.get(torch.Size(offsets))
        if same is not None:  # a tied embedding's two copies on one rank: read once
            self.copies.append((piece, same))
        else:
            pieces.add(offsets, piece)

    def load(self) -> None:
        load_store(self.root, self.wanted, PiecesPlanner())
        for to, source in self.copies:
            to.copy_(source)


def _install(optimizer: Any, moments: list, step: Any) -> None:
    """Gives ``optimizer`` the loaded moments through its load_state_dict of a plain
    optimizer's state dict (its own param groups, parameters numbered over them): megart's
    Adam, or its distributed optimizer, which keeps this rank's slices of them (its
    state_dict is a collective: every rank loads)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    number = {id(p): i for i, p in enumerate(params)}
    value = float(step) if step is not None else 0.0
    state = {number[id(p)]: {"step": torch.tensor(value), **m} for p, m in moments}
    groups = optimizer.state_dict()["param_groups"]  # numbered the same way
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def load(
    root: Path,
    common: dict[str, Any],
    config: Any,
    grid: Any,
    chunks: list[Any],
    optimizer: Any,
    rng: Any,
    scaler: Any,
    load_optim: bool,
    load_rng: bool,
    directory: Any,
) -> str:
    """Restores into this rank's chunks (any layout) its slices of the torch_dist store in
    ``root``: the weights (the fp32 main weights where the store has them); with
    ``load_optim`` Adam's moments and step and the fp16 loss scaler, after Megatron's check of
    the scheduler's state against this run's flags; with ``load_rng`` the random streams where
    the layout is the saved one (else this run keeps its own, as resharding does). The
    distributed optimizer's store is megart.training.megatron_dist_distopt's; a store with
    neither optimizer's keys for this model is refused, naming --finetune and
    --no-load-optim. Returns what it left out, for the log."""
    load_expert_bias(root, chunks, grid.tp_rank)
    reads = _Reads(root)
    saved = common.get("optimizer") or {}
    if load_optim and distopt.is_distributed(common):
        grad_scaler = _load_distributed(
            root, reads.meta, common, config, grid, chunks, optimizer, directory
        )
        if scaler is not None and grad_scaler:  # the store's object; common.pt has none
            scaler.load_state_dict(from_grad_scaler(grad_scaler))
        return _load_rng(root, reads.meta, config, grid, rng) if load_rng else ""
    saved = dense_part(saved)
    nested = "optimizer" in saved  # Float16OptimizerWithFloat16Params's layout
    inner = saved.get("optimizer", saved)
    if load_optim:
        check_scheduler(common.get("opt_param_scheduler") or {}, config, directory)
        groups = inner.get("param_groups")
        if groups is None:
            raise _foreign(root, "its common.pt holds no optimizer param groups")
        _check_groups(groups, optimizer, directory)
    # The fp32 main weights where the store has them (--bf16/--fp16), not their 16-bit casts.
    main = FP32 if load_optim and nested else ""
    moments: list[tuple[torch.nn.Parameter, dict[str, torch.Tensor]]] = []
    with torch.no_grad():
        for place in places(chunks, grid.tp_rank, config.tp):
            reads.add(main + place.key, place, place.param.detach())
            if load_optim:
                state = {n: torch.zeros_like(place.param, dtype=torch.float32) for n in MOMENTS}
                for name, tensor in state.items():
                    reads.add(moment_key(name, place.key), place, tensor)
                moments.append((place.param, state))
        reads.load()
    if load_optim:
        _install(optimizer, moments, inner.get("state", {}).get("common_step"))
    if load_optim and scaler is not None and saved.get("grad_scaler"):
        scaler.load_state_dict(from_grad_scaler(saved["grad_scaler"]))
    return _load_rng(root, reads.meta, config, grid, rng) if load_rng else ""


def dense_part(saved: dict[Any, Any]) -> dict[str, Any]:
    """common.pt's optimizer of one optimizer: a ChainedOptimizer's (expert parallelism:
    ``{0: the dense parameters', 1: the experts'}``) first part, whose groups are megart's
    (every group has dense parameters) and whose step is the chain's (Megatron-Core keeps
    them in step); the moments of both parts are under the model's keys alike."""
    return saved[0] if 0 in saved and 1 in saved else saved


def load_expert_bias(root: Path, chunks: list[Any], tp_rank: int) -> None:
    """The routers' expert biases of this rank's chunks from the store in ``root`` (any
    layout: each layer's row of its key), where the model has them; a store saved without
    them leaves them at zero, as a new run's (as megart's other formats do)."""
    wanted = bias_places(chunks, tp_rank)
    if not wanted:
        return
    reads = _Reads(root)
    if wanted[0].key not in reads.meta:
        return
    with torch.no_grad():
        for place in wanted:
            reads.add(place.key, place, place.param)
        reads.load()


def _check_groups(groups: list[Any], optimizer: Any, directory: Any) -> None:
    if len(groups) != len(optimizer.param_groups):
        raise ConfigError(
            f"--load {directory}: its optimizer has {len(groups)} param groups, this "
            f"run's {len(optimizer.param_groups)}; resume with the saved --decoupled-lr, "
            "or add --no-load-optim"
        )


def _load_distributed(
    root: Path,
    meta: dict[str, Any],
    common: dict[str, Any],
    config: Any,
    grid: Any,
    chunks: list[Any],
    optimizer: Any,
    directory: Any,
) -> dict[str, Any] | None:
    """The distributed optimizer's store (megart.training.megatron_dist_distopt): the fp32
    main weights and moments from this rank's group's buckets (under expert parallelism from
    the chain's two optimizers' buckets) and the step from its objects, into any layout.
    Returns the stored grad scaler state (None without one)."""
    check_scheduler(common.get("opt_param_scheduler") or {}, config, directory)
    args = vars(common["args"])
    distopt.check_sharding(root, distopt.sharding_of(common))
    # Megatron-LM reads only the saved tensor/pipeline layout; megart reshards the rest, and
    # reads a chain's store (expert parallelism) through the index at any layout.
    direct = distopt.same_layout(args, config) and saved_ep(args, chunks[0].cfg) == 1
    read = distopt.read_state if direct else read_resharded
    with torch.no_grad():
        moments, step, groups, grad_scaler = read(root, meta, args, grid, config.tp, chunks)
    _check_groups(groups, optimizer, directory)
    _install(optimizer, moments, step)
    return grad_scaler


def _load_rng(root: Path, meta: dict[str, Any], config: Any, grid: Any, rng: Any) -> str:
    """This rank's random streams, where the store has them for this layout."""
    key = rng_key(grid.pp_rank, grid.tp_rank, config.pp, config.tp)
    if key not in meta:
        return "; its random states are of another layout: this run keeps its own"
    record = {key: None}
    planner = dcp.DefaultLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False)
    load_store(root, record, planner)
    try:
        r = record[key][0][0]  # the strategy's list around Megatron's list per data rank
        states = GeneratorStates(r["torch_rng_state"], r.get("cuda_rng_state"))
    except (TypeError, IndexError, KeyError) as e:
        raise ConfigError(
            f"{root}: its {key} is not Megatron-LM's random states ({e!r}); add --no-load-rng"
        ) from e
    states.install()
    install_host_generators(r.get("random_rng_state"), r.get("np_rng_state"))
    if r.get("megart_rng_tracker") is not None:  # Megatron-LM's are CUDA streams: not taken
        rng.set_states(r["megart_rng_tracker"])
    return ""
