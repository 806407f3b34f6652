"""A selftest check's result, and the table and JSON that report a run of them."""

from __future__ import annotations

import json
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

PASS, FAIL, SKIP = "pass", "fail", "skip"


@dataclass
class Check:
    """One component checked: ``error`` is the largest relative error against the reference,
    ``time_ratio`` megart's time over torch's equivalent (below 1: megart is faster), ``avoid``
    the flag that keeps megart off the component when it failed."""

    name: str
    status: str
    detail: str = ""
    error: float | None = None
    time_ratio: float | None = None
    avoid: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def skip(name: str, reason: str) -> Check:
    return Check(name, SKIP, reason)


def judged(
    name: str,
    error: float,
    tolerance: float,
    time_ratio: float | None = None,
    avoid: str | None = None,
    what: str = "",
) -> Check:
    """pass when ``error`` is within ``tolerance`` (a NaN error fails)."""
    ok = error <= tolerance
    detail = f"{what}max rel. error {error:.2e} (tolerance {tolerance:.0e})".strip()
    if not ok and avoid:
        detail += f"; avoid it with {avoid}"
    return Check(name, PASS if ok else FAIL, detail, error, time_ratio, None if ok else avoid)


def guarded(name: str, fn: Callable[[], list[Check]], avoid: str | None = None) -> list[Check]:
    """Runs ``fn``; a check that raises is a failure that names the exception (and the flag
    that avoids the component)."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - every failure becomes a reported check
        last = traceback.format_exception_only(type(e), e)[-1].strip()
        detail = last + (f"; avoid it with {avoid}" if avoid else "")
        return [Check(name, FAIL, detail, avoid=avoid)]


def timed(fn: Callable[[], Any], repeats: int = 5) -> float:
    """The median of ``repeats`` timings of ``fn`` after one warm-up call (seconds), the GPU
    synchronised around each (when torch has started CUDA)."""
    import torch

    def sync() -> None:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()

    fn()
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def relative_error(got: Any, want: Any) -> float:
    """max |got - want| / max(max |want|, tiny), in float64 (NaN anywhere gives inf)."""
    import torch

    g, w = got.detach().double().cpu(), want.detach().double().cpu()
    if g.shape != w.shape:
        return float("inf")
    if not torch.isfinite(g).all():
        return float("inf")
    scale = max(w.abs().max().item() if w.numel() else 0.0, 1e-12)
    return (g - w).abs().max().item() / scale if w.numel() else 0.0


def table(checks: Iterable[Check]) -> str:
    # The checks time small inputs, so the ratio is per-call cost (host and launch), not a
    # kernel's speed at model sizes, which bench/ measures: the header says so.
    rows = [("component", "result", "error vs reference", "time vs torch, small", "detail")]
    for c in checks:
        rows.append(
            (
                c.name,
                c.status.upper(),
                "" if c.error is None else f"{c.error:.1e}",
                "" if c.time_ratio is None else f"{c.time_ratio:.3g}x",
                c.detail,
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = [
        "  ".join(v.ljust(w) for v, w in zip(r[:4], widths, strict=False)) + "  " + r[4]
        for r in rows
    ]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(line.rstrip() for line in lines)


def summary(checks: list[Check]) -> str:
    n = {s: sum(c.status == s for c in checks) for s in (PASS, FAIL, SKIP)}
    text = f"{n[PASS]} passed, {n[FAIL]} failed, {n[SKIP]} skipped"
    avoid = sorted({c.avoid for c in checks if c.status == FAIL and c.avoid})
    if avoid:
        text += "; to train without the failing parts use " + " ".join(avoid)
    return text


def to_json(checks: list[Check]) -> str:
    return json.dumps({"checks": [asdict(c) for c in checks]}, indent=1)


def exit_status(checks: list[Check]) -> int:
    return 1 if any(c.status == FAIL for c in checks) else 0
