"""``megart selftest``: checks every component megart would use on this machine.

One process: the C++ core, AdamW against torch's, the fused kernels, the mixture-of-experts
layer in fp32 and bf16 against float64, the shm transport and a tensor-parallel training run on
2 launched ranks (against gloo and the one-process curve), and on a GPU also NCCL, one-rank
nccl collectives against torch's NCCL, the CUDA AdamW against torch.optim.AdamW(fused=True),
the mixture-of-experts layer on CUDA and a GPU training run against the CPU curve. Under
torchrun with several ranks: every collective and point-to-point op of megart's default
transport against torch.distributed's on the same ranks, and training over that transport
against the one-process curve: over two pipeline stages (interleaved and zb-v), with context
parallelism, and a Llama-style GPT under tensor and sequence parallelism.
"""

from __future__ import annotations

import os
from typing import Any

from megart.selftest.report import FAIL, Check, guarded, skip

AVOID_TRANSPORT = "--distributed-backend torch"


def _no_gpu_reason() -> str | None:
    import torch

    if not torch.cuda.is_available():
        return f"no GPU: torch {torch.__version__} sees no CUDA device"
    try:
        from megart import _cuda  # noqa: F401
    except ImportError:
        return "megart was built without CUDA (no nvcc at install): reinstall where one is found"
    return None


def _two_ranks() -> list[Check]:
    """On each of 2 launched CPU ranks: the shm transport against gloo, and tp2 training."""
    import torch

    import megart.distributed as dist
    from megart.selftest import collectives, training

    dist.init(backend="shm")
    reference = dist.new_group(backend="torch")
    checks = collectives.compare(
        _world(),
        reference,
        torch.device("cpu"),
        "shm",
        dtypes=(torch.float32, torch.bfloat16),
    )
    history = training.curve(tensor_model_parallel_size=2)
    return [*checks, history]  # the curve is judged by the caller, against one process


def _world() -> Any:
    from megart.distributed.group import context

    return context().world


def _launched_checks(reference_curve: list[dict]) -> list[Check]:
    from megart.launcher import launch
    from megart.selftest import training

    # CPU ranks even on a GPU machine: the shm transport moves host memory.
    results = launch(_two_ranks, 2, timeout=300, env={"CUDA_VISIBLE_DEVICES": ""})
    *checks, history = results[0]
    return [
        *checks,
        training.compare_curves(
            "training tp2 (shm, 2 ranks)", history, reference_curve, 1e-5, AVOID_TRANSPORT
        ),
    ]


def _cpu_reference_curve(kw: dict | None = None) -> list[dict]:
    from megart.launcher import launch
    from megart.selftest import training

    no_gpu = {"CUDA_VISIBLE_DEVICES": ""}
    return launch(training.one_process_curve, 1, kw, timeout=300, env=no_gpu)[0]


def _gpu_checks(reference_curve: list[dict]) -> list[Check]:
    import torch

    import megart.distributed as dist
    from megart.distributed.nccl import find_nccl
    from megart.selftest import (
        collectives,
        components,
        moe,
        ring_blocks,
        sinks,
        training,
        windows,
    )
    from megart.selftest.ring_window_blocks import check_ring_window_blocks

    device = torch.device("cuda", torch.cuda.current_device())
    checks: list[Check] = []
    found = find_nccl()
    if found is None:
        checks.append(
            Check(
                "NCCL",
                FAIL,
                "not found; set MEGART_NCCL_LIBRARY or pip install "
                f"nvidia-nccl-cu12; until then use {AVOID_TRANSPORT}",
                avoid=AVOID_TRANSPORT,
            )
        )
    else:
        checks.append(Check("NCCL", "pass", f"version {found[1]} at {found[0]}"))

        def one_rank() -> list[Check]:
            dist.init(backend="nccl")
            try:
                reference = dist.new_group(backend="torch")
                return collectives.compare(_world(), reference, device, "nccl one-rank")
            finally:
                dist.destroy()

        checks += guarded("nccl one-rank collectives", one_rank, AVOID_TRANSPORT)
    checks += guarded("kernels (CUDA)", lambda: components.check_kernels(device))
    checks += guarded(
        "ring attention flash blocks (CUDA)",
        lambda: ring_blocks.check_ring_blocks(device),
        "--cp-comm-type all_gather",
    )
    checks += guarded(
        "ring attention windowed blocks (CUDA)",
        lambda: check_ring_window_blocks(device),
        "--cp-comm-type all_gather",
    )
    checks += guarded("sliding window (CUDA)", lambda: windows.check_sliding_window(device))
    checks += guarded("attention sinks (CUDA)", lambda: sinks.check_sinks(device))
    checks += guarded("mixture of experts (CUDA)", lambda: moe.check_moe(device))
    checks += guarded("AdamW (CUDA)", lambda: components.check_adamw(device))
    checks += guarded(
        "gradient accumulation fusion (CUDA)",
        lambda: components.check_grad_accumulation_fusion(device),
        "--no-gradient-accumulation-fusion",
    )

    def gpu_training() -> list[Check]:
        got = training.one_process_curve()
        # GPU and CPU round differently (other kernels, other summation orders): 1e-3.
        return [training.compare_curves("training on GPU vs CPU", got, reference_curve, 1e-3, None)]

    checks += guarded("training on GPU", gpu_training)
    return checks


def run_single() -> list[Check]:
    """Every check of one process (launching 2 CPU ranks for the transport and training)."""
    import torch

    from megart.selftest import components, moe, ring_blocks, sinks, training, windows
    from megart.selftest.ring_window_blocks import check_ring_window_blocks

    checks: list[Check] = []
    checks += guarded("core", components.check_core)
    checks += guarded("AdamW (C++)", lambda: components.check_adamw(torch.device("cpu")))
    checks += guarded(
        "gradient accumulation fusion (CPU)",
        lambda: components.check_grad_accumulation_fusion(torch.device("cpu")),
        "--no-gradient-accumulation-fusion",
    )
    checks += guarded(
        "ring attention flash blocks (CPU)",
        lambda: ring_blocks.check_ring_blocks(torch.device("cpu")),
        "--cp-comm-type all_gather",
    )
    checks += guarded(
        "ring attention windowed blocks (CPU)",
        lambda: check_ring_window_blocks(torch.device("cpu")),
        "--cp-comm-type all_gather",
    )
    checks += guarded(
        "sliding window (CPU)", lambda: windows.check_sliding_window(torch.device("cpu"))
    )
    checks += guarded("mixture of experts (CPU)", lambda: moe.check_moe(torch.device("cpu")))
    checks += guarded("attention sinks (CPU)", lambda: sinks.check_sinks(torch.device("cpu")))
    no_gpu = _no_gpu_reason()
    if no_gpu is None:
        reference = _cpu_reference_curve()
    else:
        reference = training.one_process_curve()
    checks += guarded(
        "shm transport (2 ranks)", lambda: _launched_checks(reference), AVOID_TRANSPORT
    )
    if no_gpu is not None:
        for name in (
            "NCCL",
            "nccl one-rank collectives",
            "kernels (CUDA), every dtype",
            "ring attention flash blocks (CUDA)",
            "ring attention windowed blocks (CUDA)",
            "sliding window (CUDA)",
            "mixture of experts (CUDA)",
            "AdamW (CUDA) vs torch fused",
            "training on GPU vs CPU",
        ):
            checks.append(skip(name, no_gpu))
        checks.append(
            skip(
                "collectives under torchrun vs torch NCCL",
                f"{no_gpu} (on CPU `torchrun -m megart selftest` compares shm with gloo)",
            )
        )
        return checks
    return checks + _gpu_checks(reference)


def run_distributed() -> list[Check]:
    """Under torchrun: every op of megart's default transport against torch.distributed's on
    all ranks (NCCL on GPUs, gloo on CPU). Every rank returns the same verdicts."""
    import torch

    import megart.distributed as dist
    from megart.selftest import collectives

    def compare() -> list[Check]:
        dist.init()
        # Ended before the interpreter exits: a torch.distributed group left to the
        # interpreter's shutdown can abort the process there (seen: 1 run in 6 under torchrun).
        try:
            backend = _world().backend
            device = (
                torch.device("cuda", torch.cuda.current_device())
                if backend == "nccl"
                else torch.device("cpu")
            )
            reference = dist.new_group(backend="torch")
            return collectives.compare(
                _world(), reference, device, f"{backend} {dist.get_world_size()} ranks"
            )
        finally:
            dist.destroy()

    checks = guarded("collectives under torchrun", compare, AVOID_TRANSPORT)
    checks += guarded("pipeline training under torchrun", _pipeline_training, AVOID_TRANSPORT)
    return checks + guarded("layouts under torchrun", _layout_training, AVOID_TRANSPORT)


def _halves_refused(world: int) -> str | None:
    """Why the training checks under torchrun cannot use ``world`` ranks, or None: they need an
    even number of ranks whose half divides the tiny GPT's heads."""
    from megart.selftest import training

    heads = training.TINY["num_attention_heads"]
    if world % 2 or heads % (world // 2):
        return f"needs an even number of ranks whose half divides {heads} heads, not {world}"
    return None


def _trained_against_cpu(runs: list[tuple[str, dict, dict]], world: int) -> list[Check]:
    """Each (name, model, layout) run: the tiny GPT with ``model``'s flags trained over
    megart's default transport in ``layout`` on every rank, against its one-process CPU curve.
    Every rank computes the curves in processes of its own, so every rank judges alike."""
    import megart.distributed as dist
    from megart.selftest import training

    curves: dict[tuple, list[dict]] = {}  # one reference per model, shared by its layouts
    references = []
    for _, model, _ in runs:
        key = tuple(sorted(model.items()))
        if key not in curves:
            curves[key] = _cpu_reference_curve(model)
        references.append(curves[key])
    dist.init()
    try:
        backend = _world().backend
        rtol = 1e-3 if backend == "nccl" else 1e-5  # GPU and CPU round differently
        checks = []
        for (name, model, layout), reference in zip(runs, references, strict=True):
            history = training.curve(**model, **layout)
            name = f"{name} ({backend}, {world} ranks)"
            checks.append(training.compare_curves(name, history, reference, rtol, AVOID_TRANSPORT))
        return checks
    finally:
        dist.destroy()


def _pipeline_training() -> list[Check]:
    """The tiny GPT trained over two pipeline stages (tensor parallelism over the rest of the
    ranks) under the multi-chunk schedules, whose posting plans NCCL must match."""
    world = int(os.environ["WORLD_SIZE"])
    why = _halves_refused(world)
    if why:
        return [skip("pipeline training under torchrun", why)]
    tp = world // 2
    runs = [
        (f"training tp{tp} pp2 {schedule}", {},
         dict(tensor_model_parallel_size=tp, pipeline_model_parallel_size=2,
              pipeline_schedule=schedule, num_layers_per_virtual_pipeline_stage=chunk_layers))
        for schedule, chunk_layers in (("interleaved", 1), ("zb-v", None))
    ]  # fmt: skip
    return _trained_against_cpu(runs, world)


def _layout_training() -> list[Check]:
    """Context parallelism (cp2, tensor parallelism over the rest of the ranks), all-gathered
    and around the ring (--cp-comm-type p2p: NCCL's point-to-point sends), and a Llama-style
    GPT (grouped queries, SwiGLU, query/key norms) under tp2 with sequence parallelism (data
    parallelism over the rest)."""
    from megart.selftest import training

    world = int(os.environ["WORLD_SIZE"])
    why = _halves_refused(world)
    if why:
        return [skip("layouts under torchrun", why)]
    runs = [
        (f"training cp2 all-gather tp{world // 2}", {},
         dict(context_parallel_size=2, tensor_model_parallel_size=world // 2,
              cp_comm_type="all_gather")),
        (f"training cp2 ring tp{world // 2}", {},
         dict(context_parallel_size=2, tensor_model_parallel_size=world // 2,
              cp_comm_type="p2p")),
        ("training llama-style tp2 sp qk-layernorm", training.LLAMA,
         dict(tensor_model_parallel_size=2, sequence_parallel=True)),
    ]  # fmt: skip
    return _trained_against_cpu(runs, world)


def run() -> list[Check]:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return run_distributed() if world > 1 else run_single()
