"""Reading the SASS of a built CUDA binary: which kernels it holds, whether their global loads and
stores are 128 bits wide, and whether they touch local memory (register spills). Used by
tests/test_cuda_sass.py on megart's ``_cuda`` module; no GPU needed."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

# The CUDA toolkit's disassembler, or the one the nvidia-cuda-cuobjdump wheel installs (with
# nvidia-cuda-nvdisasm, which cuobjdump calls) when the toolkit was installed without it.


def _wheel_bins() -> list[Path]:
    import importlib.util

    spec = importlib.util.find_spec("nvidia")
    roots = list(spec.submodule_search_locations or []) if spec else []
    return [Path(r) / sub / "bin" for r in roots for sub in ("cu13", "cu12")]


def find_tool(name: str) -> Path | None:
    """``name`` (cuobjdump, nvdisasm) beside nvcc, on PATH, or from the nvidia wheels."""
    places: list[Path] = []
    nvcc = shutil.which("nvcc")
    if nvcc:
        real = Path(nvcc).resolve()
        places.append(real.parent)
        # /usr/local/bin/nvcc may be a wrapper script that execs the toolkit's nvcc.
        text = real.read_bytes()[:4096] if real.stat().st_size < 4096 else b""
        for match in re.finditer(rb"(/\S+)/nvcc\b", text):
            places.append(Path(match.group(1).decode()))
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            places.append(Path(os.environ[var]) / "bin")
    places.append(Path("/usr/local/cuda/bin"))
    found = shutil.which(name)
    if found:
        places.append(Path(found).parent)
    places.extend(_wheel_bins())
    for place in places:
        if (place / name).is_file() and os.access(place / name, os.X_OK):
            return place / name
    return None


@dataclass
class Kernel:
    arch: str  # sm_80, sm_90
    mangled: str
    sass: str

    def count(self, pattern: str) -> int:
        return len(re.findall(pattern, self.sass))

    @property
    def wide_loads(self) -> int:
        return self.count(r"\bLDG\.E\.128\b")

    @property
    def wide_stores(self) -> int:
        return self.count(r"\bSTG\.E\.128\b")

    @property
    def local_accesses(self) -> int:
        return self.count(r"\b(?:LDL|STL)(?:\.[A-Z0-9]+)*\s")


def disassemble(binary: Path) -> list[Kernel]:
    """Every kernel of every architecture in ``binary`` (a shared object or cubin)."""
    cuobjdump = find_tool("cuobjdump")
    nvdisasm = find_tool("nvdisasm")
    if cuobjdump is None or nvdisasm is None:
        raise FileNotFoundError(
            "cuobjdump and nvdisasm are needed: install the CUDA toolkit's, or "
            "`pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm`"
        )
    env = dict(os.environ, PATH=f"{nvdisasm.parent}{os.pathsep}{os.environ.get('PATH', '')}")
    text = subprocess.run(
        [str(cuobjdump), "-sass", str(binary)],
        check=True,
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    ).stdout
    kernels: list[Kernel] = []
    arch = "?"
    lines: list[str] = []
    current: tuple[str, str] | None = None

    def flush() -> None:
        if current is not None:
            kernels.append(Kernel(current[0], current[1], "\n".join(lines)))

    for line in text.splitlines():
        if m := re.search(r"arch = (sm_\d+a?)", line):
            flush()
            current, lines = None, []
            arch = m.group(1)
        elif m := re.search(r"Function : (\S+)", line):
            flush()
            current, lines = (arch, m.group(1)), []
        elif current is not None:
            lines.append(line)
    flush()
    return kernels


def problems(kernel: Kernel, loads: bool = True, stores: bool = True) -> list[str]:
    """What keeps ``kernel`` from the hot-loop bar: 128-bit global loads (and stores) and no
    local memory. Empty when it meets it."""
    out = []
    if loads and kernel.wide_loads == 0:
        out.append("no 128-bit global load (LDG.E.128)")
    if stores and kernel.wide_stores == 0:
        out.append("no 128-bit global store (STG.E.128)")
    if kernel.local_accesses:
        out.append(f"{kernel.local_accesses} local-memory accesses (LDL/STL: spills)")
    return out


def resource_usage(binary: Path) -> dict[tuple[str, str], dict[str, int]]:
    """ptxas's per-kernel resources (as ``nvcc -Xptxas -v`` prints at build time), read back from
    the binary: {(arch, mangled name): {"REG": .., "STACK": .., "LOCAL": .., ...}}."""
    cuobjdump = find_tool("cuobjdump")
    assert cuobjdump is not None
    text = subprocess.run(
        [str(cuobjdump), "-res-usage", str(binary)],
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    usage: dict[tuple[str, str], dict[str, int]] = {}
    arch = "?"
    name = None
    for line in text.splitlines():
        if m := re.search(r"arch = (sm_\d+a?)", line):
            arch = m.group(1)
        elif m := re.search(r"Function (\S+):", line):
            name = m.group(1)
        elif name is not None and "REG:" in line:
            fields = dict(re.findall(r"([A-Z]+(?:\[\d+\])?):(\d+)", line))
            usage[(arch, name)] = {k: int(v) for k, v in fields.items()}
            name = None
    return usage
