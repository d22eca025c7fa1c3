"""Compiling the C kernels once per machine and loading them with ctypes.

The shared library is built with `-march=native` (AVX-512 / bf16 instructions where the CPU has
them), so it is cached per source, compiler flags and CPU: `$BERTH_KERNEL_CACHE`, else
`~/.cache/berth/kernels`; `BERTH_CPU_ISA=avx2` builds for AVX2 + FMA only instead (`isa`).
Building takes about a second; the library is written under a temporary name and renamed, so
processes building at the same time never load a half-written file.
The compiler is `$CC`, else `cc`. Without one (or if it fails) `load` returns None and the
caller keeps the torch path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

# The instruction sets the CPU backend may use (`$BERTH_CPU_ISA`): "native", everything this
# CPU has; "avx2", what a CPU without AVX-512 has (x86-64-v3: AVX2, FMA, F16C), so that the path
# an AVX2-only machine runs (gemm.c for both dtypes, no AVX-512 in any kernel) can be run and
# tested on any x86 machine. With "avx2", torch's own kernels are kept to AVX2 as well when the
# process starts with it set (ONEDNN_MAX_CPU_ISA, ATEN_CPU_CAPABILITY, unless set already).
ISAS = {"native": "-march=native", "avx2": "-march=x86-64-v3"}


def isa() -> str:
    chosen = os.environ.get("BERTH_CPU_ISA", "native")
    if chosen not in ISAS:  # a typo must not silently run another path than the one asked for
        raise ValueError(f"BERTH_CPU_ISA must be one of {sorted(ISAS)}, got {chosen!r}")
    return chosen


if isa() == "avx2":
    os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX2")
    os.environ.setdefault("ATEN_CPU_CAPABILITY", "avx2")


def compile_flags(name: str) -> list[str]:
    # -ffast-math lets the kernels' loops vectorize (reassociated sums, glibc's vector expf). It
    # is given to the compile step only: linked with it, gcc adds crtfastmath.o, which switches
    # the whole process to flush subnormals to zero the moment the library is loaded.
    flags = ["-O3", ISAS[isa()], "-ffast-math", "-fopenmp", "-fPIC", "-std=c11"]
    if name == "elementwise":
        # Its results are torch's to the bit (one multiply, one add, one rounding each, as torch's
        # operators do): a fused multiply-add rounds once less, and which products gcc fuses
        # depends on the vector width it targets (with AVX2 alone, RoPE's bfloat16 results differed).
        flags.append("-ffp-contract=off")
    return flags


LINK_FLAGS = ["-shared", "-fopenmp"]


def cache_dir() -> Path:
    configured = os.environ.get("BERTH_KERNEL_CACHE")
    return Path(configured) if configured else Path.home() / ".cache" / "berth" / "kernels"


def _cpu_identity() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return os.uname().machine


@functools.cache
def load(name: str) -> ctypes.CDLL | None:
    """The library built from `NAME.c` beside this file, or None where it cannot be built."""
    source = Path(__file__).with_name(f"{name}.c")
    wanted = os.environ.get("CC") or "cc"
    compiler = shutil.which(wanted)
    if compiler is None:
        logger.warning("no C compiler %r found: the CPU backend uses torch for %s", wanted, name)
        return None
    digest = hashlib.sha256(source.read_bytes())
    for header in sorted(source.parent.glob("*.h")):  # what the source includes
        digest.update(header.read_bytes())
    for part in (compiler, *compile_flags(name), *LINK_FLAGS, _cpu_identity()):
        digest.update(part.encode())
    target = cache_dir() / f"{name}-{digest.hexdigest()[:16]}.so"
    if not target.is_file():
        try:
            _build(compiler, source, target)
        except (OSError, subprocess.CalledProcessError) as error:
            detail = getattr(error, "stderr", "") or error
            logger.warning("building %s failed, the CPU backend uses torch for it: %s", source.name, detail)
            return None
    return ctypes.CDLL(str(target))


def _build(compiler: str, source: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, partial = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    os.close(handle)
    obj = f"{partial}.o"

    def run(*command: str) -> None:
        subprocess.run([compiler, *command], check=True, capture_output=True, text=True, timeout=120)

    try:
        run(*compile_flags(source.stem), "-c", str(source), "-o", obj)
        run(*LINK_FLAGS, obj, "-o", partial, "-lm")
        os.replace(partial, target)
    finally:
        for leftover in (partial, obj):
            if os.path.exists(leftover):
                os.unlink(leftover)
