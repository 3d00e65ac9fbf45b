"""Small factories the tests share."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvflow.kv_manager import KVCacheManager
from kvflow.orchestrator.options import EngineOptions
from kvflow.orchestrator.request import Request
from kvflow.orchestrator.sampling.params import SamplingParams
from kvflow.orchestrator.scheduler.output import RunnerOutput, SchedulerOutput
from kvflow.orchestrator.scheduler.registry import make_scheduler
from kvflow.runtime.base import ModelRunner
from kvflow.runtime.step_builder import SeqChunk, build_step

# The scheduler's factories: hand-built requests, a scheduler on a small KV pool, and a runner
# written by hand (no model). EOS ends a request; TOKEN is what the hand runner samples.
EOS = 2
TOKEN = 7


class FakeClock:
    """A clock the test moves by setting ``now``."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make_scheduler_for_test(num_blocks=64, block_size=4, clock=None, num_host_blocks=0, **cfg):
    """A scheduler over ``num_blocks`` KV blocks, with a 16-token step budget unless ``cfg``
    says otherwise (any other :class:`EngineOptions` field too)."""
    config = EngineOptions(**{"max_num_batched_tokens": 16, "max_model_len": 256,
                                "enable_prefix_caching": False, **cfg})
    kv = KVCacheManager(num_blocks, block_size, enable_caching=config.enable_prefix_caching,
                        num_host_blocks=num_host_blocks, bytes_per_block=1024)
    return make_scheduler(config, kv, clock or FakeClock())


def make_request(rid, prompt_len, max_tokens=4, priority=0, arrival=0.0, tenant=None,
                 **params):
    """A request of ``prompt_len`` distinct prompt tokens; ``params`` are SamplingParams'."""
    return Request(rid, list(range(10, 10 + prompt_len)),
                   SamplingParams(max_tokens=max_tokens, **params), arrival, priority, (EOS,),
                   tenant=tenant)


def run_step(sched, token=TOKEN, tokens=None) -> SchedulerOutput:
    """One step with a runner that samples ``token`` (or ``tokens[request_id]``) for everyone."""
    out = sched.schedule()
    sampled = {s.request.request_id: (tokens or {}).get(s.request.request_id, token)
               for s in out.scheduled if s.sample}
    sched.update_from_output(out, RunnerOutput(sampled))
    sched.check_integrity()
    return out


def chunks(out: SchedulerOutput) -> dict[str, int]:
    """request id -> tokens scheduled for it in the step ``out``."""
    return {s.request.request_id: s.num_new_tokens for s in out.scheduled}


def greedy_generate(runner: ModelRunner, prompt: Sequence[int], max_new: int,
                    chunk: int | None = None) -> tuple[list[int], list[np.ndarray]]:
    """Greedy tokens of one sequence run alone (prefill in chunks of ``chunk`` tokens)."""
    kv = KVCacheManager(runner.num_blocks, runner.engine.limits.block_size)
    seq, logits_seen = list(prompt), []
    done = 0
    try:
        while len(seq) - len(prompt) < max_new:
            n = len(seq) - done if chunk is None else min(chunk, len(seq) - done)
            assert kv.allocate_slots("s", done + n)
            sample = done + n == len(seq)
            logits = runner.execute(build_step(kv, [SeqChunk("s", seq, done, n, sample)]))
            done += n
            if sample:
                logits_seen.append(logits[0])
                seq.append(int(np.argmax(logits[0])))
    finally:
        kv.free("s")
    return seq[len(prompt):], logits_seen


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def assert_same_or_near_tie(ours: Sequence[int], ref: Sequence[int],
                            ref_logits: Sequence[np.ndarray], tol: float = 1e-4) -> None:
    """Token lists equal, or they first differ where the reference's top two are within tol."""
    i = first_divergence(ours, ref)
    if i is None:
        return
    top2 = np.sort(np.asarray(ref_logits[i], dtype=np.float64))[-2:]
    gap = float(top2[1] - top2[0])
    assert gap <= tol, (
        f"diverged at token {i}: ours {ours[i]} vs reference {ref[i]}, reference top-2 gap "
        f"{gap:.3g} > {tol} (not a near-tie)"
    )
