"""The ``draft`` proposer: a second kvflow engine drafts, step by step, batched.

The draft model (a smaller engine, or the target's own weights quantized: the 4-bit engine
drafting for the fp32 path) keeps the KV of the tokens it has seen in blocks of its own, in a
:class:`~kvflow.kv_manager.KVCacheManager` over its runner's pool, one table per running
request. Each proposal first catches the draft up with the request's accepted tokens (its
prompt, the first time; then the tokens verification emitted, minus what it already computed:
the accepted drafts are its own tokens, so only the correction or bonus token is new), then
runs ``k`` one-token steps for every drafting request together. Greedy requests draft the
draft's argmax; sampled ones draw from the draft's distribution under their temperature,
top-k, top-p and min-p (its own random stream, not the request's) and report it
(:meth:`DraftModelProposer.draft_probs`), which verification needs to stay lossless.

Its blocks exist only for running requests: after every step it frees the tables of the
requests that no longer run (finished, aborted, preempted), so nothing outlives them; a
preempted request catches up again when it runs.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvflow.kv_manager import KVCacheManager
from kvflow.orchestrator.request import Request
from kvflow.orchestrator.speculative.proposers import Proposer
from kvflow.orchestrator.speculative.verification import draw, target_distribution
from kvflow.runtime.base import ModelRunner
from kvflow.runtime.step_builder import SeqChunk, build_step


class DraftState:
    """What the draft computed for one request: the tokens whose KV is in its blocks, and the
    distributions of its last drafts (sampled requests)."""

    __slots__ = ("tokens", "probs")

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.probs: np.ndarray | None = None


class DraftModelProposer(Proposer):
    """Drafts with a second model; see the module docstring.

    Args:
        runner: the draft model's runner (its own KV pool, ``runner.num_blocks``).
        vocab_size: the target's vocabulary (the draft's must be the same).
        seed: the draft's own random stream, for sampled requests.
    """

    name = "draft"
    has_distribution = True

    def __init__(self, runner: ModelRunner, vocab_size: int, seed: int = 0) -> None:
        if runner.vocab_size != vocab_size:
            raise ValueError(f"draft_engine: the draft's vocabulary ({runner.vocab_size}) is "
                             f"not the target's ({vocab_size})")
        self.runner = runner
        self.kv = KVCacheManager(runner.num_blocks, runner.block_size)
        self.vocab_size = vocab_size
        self._rng = np.random.default_rng([seed, 77])

    def propose(self, requests: Sequence[Request], max_tokens: Sequence[int]
                ) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in requests]
        live: list[int] = []  # indexes of the requests that draft
        chunks: list[SeqChunk] = []
        for i, r in enumerate(requests):
            st = r.proposer_state
            if not isinstance(st, DraftState) or r.request_id not in self.kv.block_tables:
                st = r.proposer_state = DraftState()
            st.probs = None
            tokens = r.token_ids
            # The last token is always computed now: the first draft comes from its logits.
            done = min(_common_prefix(st.tokens, tokens), len(tokens) - 1)
            # At most the prompt is computed again; positions up to the last token run now.
            end = len(tokens) + max_tokens[i] - 1
            if max_tokens[i] < 1 or not self.kv.allocate_slots(
                    r.request_id, end, num_computed_tokens=done):
                self.kv.free(r.request_id)
                r.proposer_state = None
                continue
            del st.tokens[done:]
            st.tokens.extend(tokens[done:])
            live.append(i)
            chunks.append(SeqChunk(r.request_id, st.tokens, done, len(tokens) - done, True))
        probs: dict[int, list[np.ndarray]] = {}
        for _ in range(max(max_tokens[i] for i in live) if live else 0):
            if not chunks:
                break
            drafted = self._step(requests, live, chunks, probs)
            chunks = []
            next_live = []
            for i, token in zip(live, drafted, strict=True):
                out[i].append(token)
                st = requests[i].proposer_state
                assert isinstance(st, DraftState)
                if len(out[i]) < max_tokens[i]:  # its KV is needed: compute it next step
                    st.tokens.append(token)
                    chunks.append(SeqChunk(requests[i].request_id, st.tokens,
                                           len(st.tokens) - 1, 1, True))
                    next_live.append(i)
            live = next_live
        for i, ps in probs.items():
            st = requests[i].proposer_state
            if isinstance(st, DraftState):
                st.probs = np.stack(ps)
        return out

    def _step(self, requests: Sequence[Request], live: list[int], chunks: list[SeqChunk],
              probs: dict[int, list[np.ndarray]]) -> list[int]:
        """One draft step over ``chunks``: each live request's next draft token."""
        step = build_step(self.kv, chunks)
        params = [requests[i].sampling_params for i in live]
        if all(p.is_greedy for p in params):
            return [int(t) for t in self.runner.execute_argmax(step)]
        logits = self.runner.execute(step)[:, :self.vocab_size]
        tokens = []
        for row, (i, p) in enumerate(zip(live, params, strict=True)):
            if p.is_greedy:
                tokens.append(int(np.argmax(logits[row])))
                continue
            q = target_distribution(np.asarray(logits[row], dtype=np.float32), p)
            probs.setdefault(i, []).append(q)
            tokens.append(draw(q, float(self._rng.random())))
        return tokens

    def draft_probs(self, request: Request) -> np.ndarray | None:
        st = request.proposer_state
        return st.probs if isinstance(st, DraftState) else None

    def retain(self, running: set[str]) -> None:
        """Free the blocks of every request that no longer runs."""
        for rid in [rid for rid in self.kv.block_tables if rid not in running]:
            self.kv.free(rid)

    def close(self) -> None:
        self.runner.close()


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share (slices compare at C speed; a bisection
    finds where they part)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo
