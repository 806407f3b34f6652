"""Process groups and the one context object that holds them.

``init()`` reads torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT) and meets the other ranks through torch's TCPStore; without those variables it
makes a one-process world. Groups are passed explicitly; the world group is the default, as in
torch.distributed.

Two transports: ``shm`` (host tensors, processes of one machine) and ``nccl`` (CUDA tensors;
NCCL is loaded at run time, see :mod:`megart.distributed.nccl`); and ``torch``, which
delegates to torch.distributed's groups (gloo or NCCL, :mod:`megart.distributed.torch_backend`).
The nccl transport has run on one H200, 2026-11-26, with one rank and with two ranks sharing the GPU
(tests/test_nccl.py); never between GPUs (NVLink, InfiniBand).
"""

from __future__ import annotations

import os
import sys
import uuid
import weakref
from dataclasses import dataclass, field
from datetime import timedelta

from megart._core import comm as _comm
from megart.distributed.rendezvous import (
    Wait,
    connect,
    ended_init,
    env_int,
    exchange_pids,
    exited_soon,
    key_prefix,
    process_alive,
    under_agent,
    withdraw,
)
from megart.errors import CommError, ConfigError, MegartError, RankEnvironmentError

BACKENDS = ("shm", "nccl", "torch")


@dataclass
class ProcessGroup:
    """A set of global ranks. ``comm`` is None on processes outside the group."""

    ranks: list[int]
    name: str
    backend: str
    comm: _comm.Communicator | None = field(default=None, repr=False)
    device: int | None = None  # the CUDA device of an nccl group
    # nccl: ops whose Work was waited on with wait_stream (or dropped by a synchronous op
    # ordered on the caller's stream), kept with their tensors until they complete.
    in_flight: list = field(default_factory=list, repr=False)
    # shm: posts batch_isend_irecv's ops in one C++ call (made on first use, see ops.py).
    p2p_batcher: _comm.P2PBatcher | None = field(default=None, repr=False)
    ended: bool = False  # destroy() ended the context that made it

    def rank(self) -> int:
        """This process's rank in the group, or -1 outside it."""
        return self.comm.rank if self.comm is not None else -1

    def size(self) -> int:
        return len(self.ranks)

    def group_rank(self, global_rank: int) -> int:
        try:
            return self.ranks.index(global_rank)
        except ValueError:
            raise ConfigError(
                f"rank {global_rank} is not in group '{self.name}' (ranks {self.ranks})"
            ) from None


@dataclass
class _Context:
    rank: int
    world_size: int
    local_rank: int
    store: object
    timeout: timedelta
    world: ProcessGroup
    groups_made: int = 0
    pids: list[int] = field(default_factory=list)  # per global rank, from the rendezvous
    # How errors name a global rank; the parallel grid adds its coordinates (see describe_ranks).
    labels: list[str] = field(default_factory=list)
    nccl_library: str | None = None  # the NCCL megart loaded, once a group uses nccl
    device: int | None = None  # this process's CUDA device (LOCAL_RANK) for nccl groups
    # Every group made, so that destroy() can end those a caller still holds.
    made: list[weakref.ref] = field(default_factory=list)


_context: _Context | None = None


def _cuda_module() -> object:
    try:
        from megart import _cuda
    except ImportError as e:
        raise MegartError(
            f"the nccl backend needs megart's CUDA module, which this build lacks ({e}); "
            "reinstall megart where a CUDA toolkit (nvcc) is found, or use backend='shm'"
        ) from None
    return _cuda


def _nccl_setup(local_rank: int) -> tuple[str, int]:
    """Finds NCCL and selects this process's GPU; returns (library path, device). NCCL is
    looked for first, so a machine without it gets the loader's error listing where it looked."""
    from megart.distributed.nccl import load_nccl

    library, _version = load_nccl()
    _cuda_module()
    import torch

    if not torch.cuda.is_available():
        raise MegartError(
            f"the nccl backend needs a CUDA device, but torch sees none (torch {torch.__version__},"
            f" CUDA {torch.version.cuda}); use backend='shm' with CPU tensors"
        )
    if not 0 <= local_rank < torch.cuda.device_count():
        raise RankEnvironmentError(
            f"LOCAL_RANK={local_rank} but this process sees {torch.cuda.device_count()} GPU(s); "
            "launch one process per GPU"
        )
    torch.cuda.set_device(local_rank)
    return library, local_rank


def _join(
    store: object,
    key: str,
    ranks: list[int],
    rank: int,
    name: str,
    backend: str,
    timeout: timedelta,
    nccl: tuple[str, int] | None = None,
    pids: list[int] | None = None,
    labels: list[str] | None = None,
    board: object = None,
) -> ProcessGroup:
    """Every member calls this. shm: the group's first rank names the shared memory, the others
    read the name from the store, and all attach (a collective with a timeout). nccl: the first
    rank makes NCCL's unique id, the others read it from the store, and all create the NCCL
    communicator on their device (``nccl`` is (library path, device))."""
    group = ProcessGroup(list(ranks), name, backend)
    if backend == "torch":  # before the membership test: torch's new_group takes every rank
        from megart.distributed import torch_backend

        group.comm = torch_backend.make_comm(list(ranks), rank, name)
        group.device = torch_backend.device()
        return group
    if rank not in ranks:
        return group
    if backend == "nccl":
        assert nccl is not None
        library, device = nccl
        cuda = _cuda_module()
        if rank == ranks[0]:
            store.set(key, cuda.nccl_unique_id(library))
        unique_id = _wait_key(store, key, ranks[0], pids, timeout, name)
        group.device = device
        group.comm = cuda.create_nccl(
            library,
            bytes(unique_id),
            ranks.index(rank),
            len(ranks),
            device,
            timeout.total_seconds(),
            name,
        )
        return group
    if rank == ranks[0]:
        # The creator's pid in the name says whose job a segment is.
        store.set(key, f"/megart-{os.getpid()}-{uuid.uuid4().hex[:12]}")
    shm_name = _wait_key(store, key, ranks[0], pids, timeout, name).decode()
    group.comm = _comm.create_shm(
        shm_name,
        name,
        ranks.index(rank),
        len(ranks),
        timeout_s=timeout.total_seconds(),
        pids=[pids[r] for r in ranks] if pids else [],
        global_ranks=list(ranks),
        labels=[labels[r] for r in ranks] if labels else [],
        board=board,
    )
    return group


def _wait_key(
    store: object, key: str, writer: int, pids: list[int] | None, timeout: timedelta, group: str
) -> bytes:
    """store.get(key), which global rank ``writer`` sets; fails within ~0.1 s once the writer's
    process is gone rather than waiting out the timeout."""
    from megart.errors import CommError

    wait = Wait(timeout)
    for i in range(1 << 62):
        try:
            if store.check([key]):
                return store.get(key)
        except (RuntimeError, OSError) as e:  # torch's DistError and its kinds are RuntimeErrors
            # Without torchrun, rank 0 serves the store: its death shows up here first.
            if pids and not under_agent() and exited_soon(pids[0]):
                raise CommError(
                    f"creating group '{group}' failed: global rank 0 (pid {pids[0]}), which "
                    f"serves the rendezvous store, has exited ({str(e).splitlines()[0]})"
                ) from None
            raise
        if pids and i % 10 == 9 and not process_alive(pids[writer]):
            raise CommError(
                f"creating group '{group}' failed: global rank {writer} (pid {pids[writer]}), "
                "which sets it up, has exited"
            )
        wait.step(
            f"creating group '{group}': waiting for global rank {writer} to set it up",
            f"creating group '{group}': global rank {writer} did not set it up within "
            f"{wait.limit:.0f} s",
            0.01,
        )
    raise AssertionError("unreachable")


def init(backend: str | None = None, timeout: timedelta | float = timedelta(minutes=10)) -> None:
    """Initialises megart.distributed from torchrun's environment, or as a one-process world
    when it is absent. ``backend`` None picks ``nccl`` (CUDA tensors, device LOCAL_RANK) when
    torch sees a GPU, else ``shm`` (host tensors); ``timeout`` bounds every wait, so a dead or
    stuck peer is an error, never a hang. ``nccl`` raises MegartError listing where it looked
    when NCCL cannot be found."""
    global _context
    if _context is not None:
        raise MegartError("megart.distributed is already initialised; call destroy() first")
    if backend is None:
        import torch

        backend = "nccl" if torch.cuda.is_available() else "shm"
    if backend not in BACKENDS:
        raise ConfigError(f"unknown backend {backend!r}; use one of {', '.join(BACKENDS)}")
    if not isinstance(timeout, timedelta):
        timeout = timedelta(seconds=float(timeout))
    rank, world_size = env_int("RANK"), env_int("WORLD_SIZE")
    if (rank is None) != (world_size is None):
        raise RankEnvironmentError("set both RANK and WORLD_SIZE (torchrun does), or neither")
    import torch.distributed as td

    if rank is None:
        rank, world_size, store = 0, 1, td.HashStore()
        pids = [os.getpid()]
    else:
        if not 0 <= rank < world_size:
            raise RankEnvironmentError(f"RANK={rank} is outside WORLD_SIZE={world_size}")
        store = connect(rank, world_size, timeout)
        pids = exchange_pids(store, rank, world_size, timeout)
    local_rank = env_int("LOCAL_RANK") or 0
    nccl = _nccl_setup(local_rank) if backend == "nccl" else None
    if backend == "torch":
        from megart.distributed import torch_backend

        torch_backend.init_world(store, rank, world_size, local_rank, timeout)
    labels = [f"global rank {r}" for r in range(world_size)]
    world = _join(
        store,
        key_prefix() + "group/world",
        list(range(world_size)),
        rank,
        "world",
        backend,
        timeout,
        nccl,
        pids,
        labels,
    )
    withdraw()  # every rank has joined the world group: rank 0's host file has served
    _context = _Context(rank, world_size, local_rank, store, timeout, world, pids=pids)
    _context.labels = labels
    if nccl is not None:
        _context.nccl_library, _context.device = nccl


def context() -> _Context:
    if _context is None:
        raise MegartError("megart.distributed is not initialised: call megart.distributed.init()")
    return _context


def is_initialized() -> bool:
    return _context is not None


def destroy() -> None:
    """Ends every group (using one raises CommError, as torch.distributed refuses a destroyed
    group, rather than waiting on peers that left); init() may be called again."""
    global _context
    groups: list[ProcessGroup] = []
    if _context is not None:
        made = (ref() for ref in _context.made)
        groups = [g for g in (_context.world, *made) if g is not None]
        for group in groups:
            group.ended = True
        ended_init()
    _context = None
    backend = sys.modules.get("megart.distributed.torch_backend")
    if backend is not None:  # its groups' torch handles, and torch's group if megart started it
        backend.shutdown([group.comm for group in groups])


def new_group(ranks: list[int] | None = None, backend: str | None = None) -> ProcessGroup:
    """A group of the given global ranks (all ranks when None). As in torch.distributed, every
    process calls new_group with the same arguments in the same order, members or not."""
    ctx = context()
    ranks = list(range(ctx.world_size)) if ranks is None else [int(r) for r in ranks]
    if (
        not ranks
        or len(set(ranks)) != len(ranks)
        or not all(0 <= r < ctx.world_size for r in ranks)
    ):
        raise ConfigError(f"new_group needs distinct ranks in [0, {ctx.world_size}), got {ranks}")
    backend = backend or ctx.world.backend
    if backend not in BACKENDS:
        raise ConfigError(f"unknown backend {backend!r}; use one of {', '.join(BACKENDS)}")
    nccl = None
    if backend == "nccl":
        if ctx.nccl_library is None:
            ctx.nccl_library, ctx.device = _nccl_setup(ctx.local_rank)
        nccl = (ctx.nccl_library, ctx.device)
    if backend == "torch" and ctx.world.backend != "torch":
        from megart.distributed import torch_backend

        torch_backend.init_world(ctx.store, ctx.rank, ctx.world_size, ctx.local_rank, ctx.timeout)
    ctx.groups_made += 1
    name = f"group{ctx.groups_made}{ranks}"
    group = _join(
        ctx.store,
        f"{key_prefix()}group/{ctx.groups_made}",
        ranks,
        ctx.rank,
        name,
        backend,
        ctx.timeout,
        nccl,
        ctx.pids,
        ctx.labels,
        ctx.world.comm if ctx.world.backend == "shm" else None,
    )
    ctx.made.append(weakref.ref(group))
    return group


def describe_ranks(labels: list[str]) -> None:
    """Sets how errors of groups made from now on name each global rank (the parallel grid
    passes "global rank 2 (tp 0, pp 1, dp 0)")."""
    ctx = context()
    if len(labels) != ctx.world_size:
        raise ConfigError(f"describe_ranks needs {ctx.world_size} labels, got {len(labels)}")
    ctx.labels = list(labels)


def resolve(group: ProcessGroup | None) -> ProcessGroup:
    g = context().world if group is None else group
    if g.ended:
        raise CommError(
            f"group '{g.name}' ended with megart.distributed.destroy(); make the group again "
            "after init()"
        )
    return g


def get_rank(group: ProcessGroup | None = None) -> int:
    """This process's global rank, or its rank in ``group`` (-1 outside it)."""
    return context().rank if group is None else group.rank()


def get_world_size(group: ProcessGroup | None = None) -> int:
    return resolve(group).size()
