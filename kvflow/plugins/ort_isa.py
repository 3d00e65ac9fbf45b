"""Which instruction set the native op library (:mod:`kvflow.plugins.ort_custom_ops`) runs.

The library is compiled once per ISA (each its own ``.so``, its kernels' ``#ifdef`` paths
chosen by the flags below), and the one to load is picked at load time from this CPU's feature
flags, the widest first: a venv built on an AVX-512 machine still runs on an AVX2-only one.
``KVFLOW_ISA=portable|avx2|avxvnni|avx512vnni`` forces one (for tests and comparisons); an ISA
this CPU lacks is an error naming it and the flags the CPU has. The library checks the same
with ``__builtin_cpu_supports`` when ORT registers it (a library copied by hand).
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

from kvflow import envs

ENV = envs.ISA

# x86-64-v3: AVX2, FMA, F16C, BMI1/2, LZCNT, MOVBE (every AVX2 CPU since Haswell has them).
_V3_FLAGS = ("avx2", "fma", "f16c", "bmi1", "bmi2", "abm", "movbe")
_V3 = ("-march=x86-64-v3", "-mtune=generic")

# name -> (compiler flags, /proc/cpuinfo flags the CPU needs), the preferred first.
X86_ISAS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "avx512vnni": ((*_V3, "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq",
                    "-mavx512vnni"),
                   (*_V3_FLAGS, "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni")),
    "avxvnni": ((*_V3, "-mavxvnni"), (*_V3_FLAGS, "avx_vnni")),
    "avx2": (_V3, _V3_FLAGS),
    "portable": (("-march=x86-64", "-mtune=generic"), ()),
}
ISAS = tuple(X86_ISAS)


class IsaUnavailable(RuntimeError):
    """KVFLOW_ISA names an ISA that is unknown or that this CPU lacks."""


def is_x86() -> bool:
    """Whether this machine is x86-64 (the only one with ISA variants)."""
    return platform.machine().lower() in ("x86_64", "amd64")


def cpu_flags() -> set[str]:
    """This CPU's feature flags (``/proc/cpuinfo``), empty when unreadable."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def flags(isa: str) -> tuple[str, ...]:
    """The compiler flags of ``isa`` (off x86 only ``portable`` exists: no -march, the
    architecture's baseline)."""
    if not is_x86():
        if isa != "portable":
            raise IsaUnavailable(f"{ENV}={isa}: only 'portable' exists on {platform.machine()}")
        return ()
    return X86_ISAS[isa][0]


def supported(isa: str, cpu: set[str] | None = None) -> bool:
    """Whether this CPU runs ``isa``."""
    if not is_x86():
        return isa == "portable"
    cpu = cpu_flags() if cpu is None else cpu
    return all(f in cpu for f in X86_ISAS[isa][1])


def runnable() -> list[str]:
    """The ISAs this CPU runs, the preferred first (``portable`` always last)."""
    cpu = cpu_flags()
    return [isa for isa in ISAS if supported(isa, cpu)]


def select(forced: str | None = None) -> str:
    """The ISA to load: ``forced`` (else ``KVFLOW_ISA``) when set, else the best this CPU
    runs. Raises IsaUnavailable naming the ISA and this CPU's flags when it cannot run it."""
    forced = forced or os.environ.get(ENV) or None
    if forced is None:
        return runnable()[0]
    if forced not in ISAS:
        raise IsaUnavailable(f"{ENV}={forced} is none of {', '.join(ISAS)}")
    cpu = cpu_flags()
    if not supported(forced, cpu):
        missing = [f for f in X86_ISAS[forced][1] if f not in cpu] if is_x86() else []
        vector = sorted(f for f in cpu if f.startswith(("avx", "fma", "f16c", "sse")))
        raise IsaUnavailable(
            f"{ENV}={forced}: this CPU ({platform.machine()}) lacks {', '.join(missing) or forced}"
            f"; its vector flags: {' '.join(vector) or 'none'}")
    return forced
