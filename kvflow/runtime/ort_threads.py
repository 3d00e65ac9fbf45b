"""How many intra-op threads a step runs on, measured rather than guessed.

Each parallel ORT kernel pays a wake-up of its worker threads. On a small step (a single-stream
decode: a few hundred tiny MatMuls) that costs more than the second core gives back: measured
on the 2-core development machine, 25.5 ms a batch-1 step on one thread against 30.5 ms on two.
A large step (a prefill chunk, a big decode batch) gains nearly 2x from the second core.
Spinning (ORT's workers busy-wait after each kernel instead of sleeping) trades the wake-up
for a core kept busy between kernels.

So the runner measures, once per machine, engine and mode, a few step sizes on each candidate
setting (one thread; every core) and keeps, per size range, the fastest
(:class:`ThreadPolicy`). A setting that is within :data:`KEEP_WITHIN` of the one chosen for
larger steps is not worth a session of its own (each session holds its own copy of the prepacked
weights), so the larger steps' setting then covers the smaller ones too. The decision is cached
on disk (:func:`kvflow.envs.cache_dir`), keyed by everything it depends on, unless the machine
was busy while it measured (a load average above its core count): then it holds for this process
only, and the next load measures again.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnxruntime as ort

from kvflow import envs
from kvflow.runtime.ort_sessions import Executor

# Step sizes (tokens) measured: decode batches of 1, 8 and 64 sequences, and a 256-token
# prefill chunk; each clamped to what the engine can run (probe_sizes).
PROBE_TOKENS = (1, 8, 64, 256)
DECODE_PROBE_MAX_TOKENS = 64  # probes up to this size are decode batches, larger ones prefills
DECODE_PROBE_CONTEXT = 128  # a decode probe's sequence length, unless the window is shorter
KEEP_WITHIN = 0.05
_ROUNDS = 3


def max_step_tokens(max_model_len: int, max_num_tokens: int, max_batch_size: int) -> int:
    """The largest step an engine of these limits can be handed: ``max_num_tokens``, unless
    ``max_batch_size`` sequences of ``max_model_len`` tokens are fewer."""
    return min(max_num_tokens, max_model_len * max_batch_size)


def probe_sizes(max_tokens: int) -> tuple[int, ...]:
    """:data:`PROBE_TOKENS` clamped to ``max_tokens`` (the largest step that can happen), so
    that a small engine measures its own largest step rather than one it never runs."""
    return tuple(dict.fromkeys(min(t, max_tokens) for t in PROBE_TOKENS))


@dataclass(frozen=True)
class ProbeSequence:
    """One sequence of a probe step: ``new_tokens`` at the end of ``context`` tokens."""

    new_tokens: int
    context: int


def probe_layout(tokens: int, max_model_len: int, max_batch_size: int) -> list[ProbeSequence]:
    """The sequences of a probe step of ``tokens`` tokens within the engine's limits.

    Up to :data:`DECODE_PROBE_MAX_TOKENS` a decode batch: one new token per sequence at
    position ``min(128, max_model_len) - 1`` (more per sequence if ``max_batch_size`` is
    smaller). Beyond, a prefill chunk from position 0, in as few sequences as the window allows.
    NOTE: no position reaches ``max_model_len``: the graph's RoPE tables end there, and ORT's
    Gather fails past them.
    """
    decode = tokens <= DECODE_PROBE_MAX_TOKENS
    seqs = min(tokens, max_batch_size) if decode else -(-tokens // max_model_len)
    if tokens < 1 or seqs > max_batch_size or tokens > seqs * max_model_len:
        raise ValueError(f"a probe step of {tokens} tokens does not fit max_model_len "
                         f"{max_model_len} x max_batch_size {max_batch_size}")
    new = [tokens // seqs + (i < tokens % seqs) for i in range(seqs)]
    if decode:
        return [ProbeSequence(n, min(max(DECODE_PROBE_CONTEXT, n), max_model_len)) for n in new]
    return [ProbeSequence(n, n) for n in new]


@dataclass(frozen=True)
class ThreadSetting:
    """Intra-op threads of one ORT session, and whether its workers spin between kernels."""

    threads: int
    spinning: bool

    @property
    def label(self) -> str:
        return f"{self.threads} thread{'s' if self.threads > 1 else ''}" + (
            ", spinning" if self.spinning else "")


def candidate_settings(cores: int) -> list[ThreadSetting]:
    """One thread; and with more than one core, every core. Not spinning: a spinning pool
    keeps its cores busy between kernels, which the processes a server shares the machine
    with (tritonserver, the frontend, Dynamo's etcd and NATS) then lack; a Dynamo cluster's
    shutdown overran its test's minute with a spinning worker."""
    if cores <= 1:
        return [ThreadSetting(1, False)]
    return [ThreadSetting(1, False), ThreadSetting(cores, False)]


def available_cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover  (not Linux)
        return os.cpu_count() or 1


@dataclass(frozen=True)
class ThreadPolicy:
    """Which :class:`ThreadSetting` runs a step of a given number of tokens.

    ``ranges``: ``(max_tokens, setting)`` in ascending ``max_tokens``; the last covers every
    larger step. ``step_ms``: what the choice was made from, setting label -> probed tokens ->
    best step time (empty for a fixed policy).
    """

    ranges: tuple[tuple[int, ThreadSetting], ...]
    step_ms: dict[str, dict[int, float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.ranges:
            raise ValueError("a ThreadPolicy needs at least one range")

    @classmethod
    def fixed(cls, setting: ThreadSetting) -> ThreadPolicy:
        return cls(((1 << 62, setting),))

    def setting_for(self, num_tokens: int) -> ThreadSetting:
        for max_tokens, setting in self.ranges:
            if num_tokens <= max_tokens:
                return setting
        return self.ranges[-1][1]

    @property
    def settings(self) -> list[ThreadSetting]:
        """The distinct settings, each needing a session of its own."""
        return list(dict.fromkeys(s for _, s in self.ranges))

    def describe(self) -> str:
        parts, low = [], 1
        for i, (max_tokens, setting) in enumerate(self.ranges):
            span = f"{low}+" if i == len(self.ranges) - 1 else f"{low}-{max_tokens}"
            parts.append(f"{span} tokens: {setting.label}")
            low = max_tokens + 1
        return "; ".join(parts)

    def to_json(self) -> dict:
        return {"ranges": [[m, s.threads, s.spinning] for m, s in self.ranges],
                "step_ms": {k: {str(t): ms for t, ms in v.items()}
                            for k, v in self.step_ms.items()}}

    @classmethod
    def from_json(cls, d: dict) -> ThreadPolicy:
        return cls(tuple((int(m), ThreadSetting(int(t), bool(s))) for m, t, s in d["ranges"]),
                   {k: {int(t): float(ms) for t, ms in v.items()}
                    for k, v in d["step_ms"].items()})


def choose(step_ms: dict[ThreadSetting, dict[int, float]]) -> ThreadPolicy:
    """The policy from measured step times (setting -> tokens -> ms), as the module doc says."""
    sizes = sorted(next(iter(step_ms.values())))
    best = [min(step_ms, key=lambda s, t=t: step_ms[s][t]) for t in sizes]  # type: ignore[misc]
    # From the largest size down: keep the larger steps' setting unless another wins clearly.
    for i in range(len(sizes) - 2, -1, -1):
        keep = best[i + 1]
        if step_ms[keep][sizes[i]] <= step_ms[best[i]][sizes[i]] * (1 + KEEP_WITHIN):
            best[i] = keep
    ranges: list[tuple[int, ThreadSetting]] = []
    for i, setting in enumerate(best):
        # A boundary between two probed sizes falls at their geometric mean.
        upper = (int((sizes[i] * sizes[i + 1]) ** 0.5) if i + 1 < len(sizes) else 1 << 62)
        if ranges and ranges[-1][1] == setting:
            ranges[-1] = (upper, setting)
        else:
            ranges.append((upper, setting))
    labels = {s.label: {t: round(ms, 3) for t, ms in v.items()} for s, v in step_ms.items()}
    return ThreadPolicy(tuple(ranges), labels)


def measure(make_executor: Callable[[ThreadSetting], Executor],
            make_feeds: Callable[[int], dict[str, np.ndarray]], want: str,
            settings: list[ThreadSetting], probes: list[int] | tuple[int, ...] = PROBE_TOKENS,
            ) -> tuple[ThreadPolicy, dict[ThreadSetting, Executor]]:
    """Time every probed step size (``probes``, tokens) on every setting; returns the policy
    and the executors it keeps (those its ranges use; the others are dropped)."""
    executors = {s: make_executor(s) for s in settings}
    step_ms: dict[ThreadSetting, dict[int, float]] = {s: {} for s in settings}
    for tokens in probes:
        feeds = make_feeds(tokens)
        for ex in executors.values():
            ex.run(feeds, want)  # warm: first-run allocations, prepacking
        for _ in range(_ROUNDS):  # rounds alternate settings, so drift falls on all alike
            for s, ex in executors.items():
                t0 = time.perf_counter()
                ex.run(feeds, want)
                ms = (time.perf_counter() - t0) * 1e3
                step_ms[s][tokens] = min(ms, step_ms[s].get(tokens, float("inf")))
    policy = choose(step_ms)
    return policy, {s: executors[s] for s in policy.settings}


def cache_key(model_path: Path, **context: object) -> str:
    """Everything a measured policy depends on: the graph file, ORT, the CPU, the runner's
    mode (``context``)."""
    st = model_path.stat()
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    parts = [str(model_path.resolve()), str(st.st_size), str(st.st_mtime_ns), ort.__version__,
             cpu.strip(), str(available_cores()), json.dumps(context, sort_keys=True)]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:20]


def cached_policy(key: str) -> ThreadPolicy | None:
    path = envs.cache_dir() / "thread_policy" / f"{key}.json"
    try:
        return ThreadPolicy.from_json(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def machine_is_busy() -> bool:
    """More runnable work than cores over the last minute: timings taken now are not the
    machine's."""
    try:
        return os.getloadavg()[0] > available_cores()
    except OSError:  # pragma: no cover  (no load average)
        return False


def store_policy(key: str, policy: ThreadPolicy) -> None:
    directory = envs.cache_dir() / "thread_policy"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        tmp = directory / f".{key}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(policy.to_json(), indent=1))
        tmp.replace(directory / f"{key}.json")
    except OSError:  # a read-only home: measure again next time
        pass
