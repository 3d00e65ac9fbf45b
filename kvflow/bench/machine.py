"""What a served benchmark records about the machine: the CPU's vector ISA (and the one kvflow's
native kernels were compiled for), and the peak resident memory of a process tree (a
tritonserver and its Python backend stub, where the model lives)."""

from __future__ import annotations

import os
import platform
import threading
from pathlib import Path
from typing import Any

# The CPU flags that decide which kernels run, widest last.
ISA_FLAGS = ("avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512vl",
             "avx512_vnni", "avx512_bf16", "amx_int8")


def cpu_isa() -> dict[str, Any]:
    """``widest``: the widest vector ISA of this CPU (``AVX512-VNNI``, ``AVX2`` or the machine
    name); ``native_isa``: the variant of kvflow's native op library that loads here (None when
    it is unavailable); ``cpu_flags``: which of :data:`ISA_FLAGS` it has; ``cpus``."""
    flags: set[str] = set()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    widest = next((f.upper().replace("_", "-") for f in ("amx_int8", "avx512_vnni", "avx512f",
                                                         "avx2") if f in flags),
                  platform.machine())
    native: str | None
    try:
        from kvflow.plugins.ort_custom_ops import native_isa

        native = native_isa()
    except Exception as e:  # noqa: BLE001  reported in the report, not fatal
        native = f"error: {e}"
    return {"widest": widest, "native_isa": native,
            "cpu_flags": [f for f in ISA_FLAGS if f in flags], "cpus": os.cpu_count(),
            "model_name": _cpu_model_name()}


def _cpu_model_name() -> str | None:
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.is_file():
        return None
    for line in cpuinfo.read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return None


def tree_rss_bytes(root: int) -> int:
    """Resident memory of process ``root`` and all its descendants, in bytes (0 when gone)."""
    children: dict[int, list[int]] = {}
    rss_kb: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            text = Path(f"/proc/{entry}/status").read_text()
        except OSError:
            continue  # exited meanwhile
        fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
        pid, ppid = int(entry), int(fields.get("PPid", "0"))
        children.setdefault(ppid, []).append(pid)
        rss_kb[pid] = int(fields.get("VmRSS", "0 kB").split()[0])
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        total += rss_kb.get(pid, 0)
        todo.extend(children.get(pid, ()))
    return total * 1024


class PeakRss:
    """The peak of :func:`tree_rss_bytes` of ``root``, sampled every ``period_s`` while the
    context manager's block runs (and once at its start and end)."""

    def __init__(self, root: int, period_s: float = 0.2) -> None:
        self.root, self.period_s = root, period_s
        self.peak_bytes = 0
        self._halt = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvflow-bench-rss", daemon=True)

    def sample(self) -> None:
        self.peak_bytes = max(self.peak_bytes, tree_rss_bytes(self.root))

    def _run(self) -> None:
        while not self._halt.wait(self.period_s):
            self.sample()

    def __enter__(self) -> PeakRss:
        self.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._halt.set()
        self._thread.join(5)
        self.sample()
