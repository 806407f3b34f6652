"""The runtimes megart plan estimates, and what each cannot run or does not take.

``runtime`` "megart" is megart train, whose own flags say how it communicates; "megatron" is
Megatron-LM as the published tables ran it, described by estimate()'s options (tensor-parallel
overlap, the gradient reduction's overlap and width, blocking pipeline exchanges, interleaving's
least pipeline size, and the gradient copies below)."""

from __future__ import annotations

from megart.errors import ConfigError
from megart.plan.collectives import BACKWARD_OVERLAP, KEPT_INPUT_OVERLAP
from megart.plan.data_parallel import SINGLE_STAGE
from megart.plan.layout import ZERO_BUBBLE, Layout
from megart.plan.parameters import FP32

RUNTIMES = ("megart", "megatron")


def check_runtime(
    layout: Layout,
    runtime: str,
    dp_overlap: bool | str,
    interleaved_min_pp: int,
    grad_reduce_bytes: int = FP32,
    fp32_grad_copies: bool = False,
) -> None:
    """What the runtime cannot run, refused before any estimate (megart train's own checks
    follow in layout_config's TrainConfig)."""
    if runtime not in RUNTIMES:
        raise ConfigError(f"runtime {runtime!r}; use one of {', '.join(RUNTIMES)}")
    if runtime == "megatron" and layout.cp > 1:
        raise ConfigError(
            f"--context-parallel-size {layout.cp} with --runtime megatron: the planner models "
            "megart's context parallelism (its ring, all-gather and all-to-all), not "
            "Megatron-Core's exchanges (Transformer Engine's kernels); leave out --runtime "
            "megatron"
        )
    if dp_overlap not in (True, False, SINGLE_STAGE):
        raise ConfigError(f"dp_overlap {dp_overlap!r}; use True, False or {SINGLE_STAGE!r}")
    if runtime == "megart" and (dp_overlap is not True or grad_reduce_bytes != FP32):
        raise ConfigError(
            f"dp_overlap {dp_overlap!r} and grad_reduce_bytes {grad_reduce_bytes} describe "
            "--runtime megatron; megart's come from its flags: give --no-overlap-grad-reduce "
            "or --grad-reduce-in-bf16 instead"
        )
    if fp32_grad_copies and (runtime != "megatron" or grad_reduce_bytes == FP32):
        raise ConfigError(
            "fp32_grad_copies describes Megatron-LM's 16-bit gradients with the optimizer's "
            "fp32 copies of them: it needs runtime 'megatron' and grad_reduce_bytes 2"
        )
    if layout.kind == "interleaved" and layout.pp < interleaved_min_pp:
        # Megatron-LM's arguments.py asserted p > 2 from 182841f7df (2021) to 3ee489d9ea (2024).
        raise ConfigError(
            f"--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size "
            f">= {interleaved_min_pp} in this runtime, not {layout.pp}"
        )
    if runtime == "megatron" and layout.kind in ZERO_BUBBLE:
        raise ConfigError(
            f"--pipeline-schedule {layout.kind}: Megatron-LM has no zero-bubble schedule; "
            "use 1f1b or interleaved with --runtime megatron"
        )
    want = {"zb-h1": 1, "zb-v": 2}.get(layout.kind)
    if want is not None and layout.chunks != want:
        raise ConfigError(
            f"--pipeline-schedule {layout.kind} runs {want} model chunk(s) per rank, "
            f"not {layout.chunks}"
        )


def gradient_copy_bytes(
    fp32_grad_copies: bool, grad_reduce_bytes: int, dp_overlap: bool | str, pp: int
) -> int:
    """Bytes per gradient element that SC21's Megatron-LM (fp16) held beside the fp32 gradient
    the planner counts for its runtime (``fp32_grad_copies``; 0 otherwise).

    Its optimizer (Float16OptimizerWithFloat16Params at f32a638d2d, April 2021) stepped on fp32
    copies of the gradients (`main_param.grad = model_param.grad.float()`, or of `main_grad`),
    which its zero_grad did not free until 4fd6432de6 (2021-07-09, after Table 1's runs were
    published in April): they lasted from one step through the next backward, beside the fp16
    gradients it accumulated and all-reduced (``grad_reduce_bytes``: `param.grad` with local
    DDP, whose buffers are fp32 only with --accumulate-allreduce-grads-in-fp32, not set by
    examples/sc21). Torch's DDP (SC21's p = 1 runs: ``dp_overlap`` SINGLE_STAGE) keeps one more
    copy in its buckets: gradient_as_bucket_view is off by default, and torch's documentation
    gives the gradients' size as what turning it on saves. The planner's fp32 gradient stands
    for the fp32 copies; this is the rest. After the fix the copies still coexist with the
    others at the step (the fp16 gradients are freed only by the next zero_grad), when no
    activations are left: counting them through the backward overstates such a run by its
    activations at the peak, not by the copies."""
    if not fp32_grad_copies:
        return 0
    torch_ddp_buckets = grad_reduce_bytes if dp_overlap == SINGLE_STAGE and pp == 1 else 0
    return grad_reduce_bytes + torch_ddp_buckets


def runtime_tp_overlap(runtime: str, tp_overlap: bool | str | None, layout: Layout) -> bool | str:
    """Which tensor-parallel collectives the runtime overlaps (timing.layer_work's
    ``tp_overlap``): None, the runtime's own. megart's are its column-parallel entries' backward
    collectives, beside the products' weight gradients (tensor_parallel.column_entry), and it
    takes no other; under a zero-bubble schedule those gradients wait for W, so none.
    Megatron-LM's own, without Transformer Engine's --tp-comm-overlap: the same collectives and,
    under sequence parallelism, each input's re-gather (collectives.BACKWARD_OVERLAP)."""
    if runtime == "megart":
        if tp_overlap not in (None, KEPT_INPUT_OVERLAP):
            raise ConfigError(
                f"tp_overlap {tp_overlap!r} describes --runtime megatron; megart overlaps its "
                "column-parallel products' backward collectives, and no others"
            )
        return False if layout.kind in ZERO_BUBBLE else KEPT_INPUT_OVERLAP
    return BACKWARD_OVERLAP if tp_overlap is None else tp_overlap
