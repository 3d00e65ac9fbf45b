"""The ``draft`` proposer: a second kvflow engine drafts, step by step, batched.

The draft model (a smaller engine, or the target's own weights quantized: the 4-bit engine
drafting for the fp32 path) keeps the KV of the tokens it has seen in blocks of its own, in a
:class:`~kvflow.kv_manager.KVCacheManager` over its runner's pool, one table per running
request. Each proposal first catches the draft up with the request's accepted tokens (its
prompt, the first time; then the tokens verification emitted, minus what it already computed:
the accepted drafts are its own tokens, so only the correction or bonus token is new), then
runs ``k`` one-token steps for every drafting request together.

A proposal's first draft step computes at most ``token_budget`` tokens (the step's budget):
the requests whose catch-up fits whole go first and draft; the rest are caught up chunk by
chunk over the next proposals, drafting nothing until they are (they decode plainly
meanwhile).

Drafts are drawn the way the target will verify them
(:mod:`~kvflow.orchestrator.speculative.verification`): each request's draft ``j`` is the
sampler's own pick (:meth:`~kvflow.orchestrator.sampling.sampler.Sampler.draw`: penalties,
``min_tokens``, temperature, top-k, top-p, min-p; greedy: the argmax) from the draft's logits,
with the uniform the request's own random stream holds for its ``j``-th next token. No stream
is shared between requests, and none is advanced: a seeded request's drafts, like its tokens,
follow from its seed alone, and where the draft's distribution equals the target's, its drafts
are the target's tokens. With ``coupled`` (the engine's sampler then coupled too) both draw by
the race (:mod:`~kvflow.orchestrator.sampling.race`), and a draft close to the target is
accepted about as often as under rejection sampling (``1 - TV``); by the inverse CDF, the
token order makes that much rarer on flat distributions.

Its blocks exist only for running requests: after every step it frees the tables of the
requests that no longer run (finished, aborted, preempted), so nothing outlives them; a
preempted request catches up again when it runs.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvflow.kv_manager import KVCacheManager
from kvflow.orchestrator.request import Request
from kvflow.orchestrator.sampling.sampler import Sampler, SamplingRow, make_generator
from kvflow.orchestrator.speculative.proposers import Proposer
from kvflow.orchestrator.speculative.verification import peek_uniforms
from kvflow.runtime.base import ModelRunner
from kvflow.runtime.step_builder import SeqChunk, build_step


class DraftState:
    """What the draft computed for one request: the tokens whose KV is in its blocks; and,
    for a request without the engine's state (no random stream of its own there), the
    stream its drafts draw from."""

    __slots__ = ("tokens", "generator")

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.generator: np.random.Generator | None = None


class DraftModelProposer(Proposer):
    """Drafts with a second model; see the module docstring.

    Args:
        runner: the draft model's runner (its own KV pool, ``runner.num_blocks``).
        vocab_size: the target's vocabulary (the draft's must be the same).
        coupled: draw sampled drafts by the race (the engine's sampler must too:
            ``Sampler.coupled``).
    """

    name = "draft"

    def __init__(self, runner: ModelRunner, vocab_size: int, coupled: bool = False) -> None:
        if runner.vocab_size != vocab_size:
            raise ValueError(f"draft_engine: the draft's vocabulary ({runner.vocab_size}) is "
                             f"not the target's ({vocab_size})")
        self.runner = runner
        self.kv = KVCacheManager(runner.num_blocks, runner.block_size,
                                 sliding_window=runner.sliding_window)
        self.vocab_size = vocab_size
        self.coupled = coupled
        # The target's sampler rules, per set of EOS ids (min_tokens bans them) and way to draw.
        self._samplers: dict[tuple[tuple[int, ...], bool], Sampler] = {}

    def propose(self, requests: Sequence[Request], max_tokens: Sequence[int],
                token_budget: int | None = None) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in requests]
        budget = token_budget if token_budget is not None else 1 << 62
        live: list[int] = []  # indexes of the requests that draft
        chunks: list[SeqChunk] = []
        catching_up: list[tuple[int, int]] = []  # (request index, tokens computed before)
        for i, r in enumerate(requests):
            if max_tokens[i] < 1:
                continue
            st = self._state(r)
            tokens = r.token_ids
            # The last token is always computed now: the first draft comes from its logits.
            done = min(_common_prefix(st.tokens, tokens), len(tokens) - 1)
            if len(tokens) - done > budget:
                catching_up.append((i, done))
                continue
            # At most the prompt is computed again; positions up to the last token run now.
            if not self._allocate(r, len(tokens) + max_tokens[i] - 1, done):
                continue
            budget -= len(tokens) - done
            del st.tokens[done:]
            st.tokens.extend(tokens[done:])
            live.append(i)
            chunks.append(SeqChunk(r.request_id, st.tokens, done, len(tokens) - done, True))
        # A catch-up longer than the budget left: a chunk now, the rest in later proposals.
        for i, done in catching_up:
            r = requests[i]
            n = min(budget, len(r.token_ids) - 1 - done)
            if n < 1 or not self._allocate(r, done + n, done):
                continue
            budget -= n
            st = self._state(r)
            del st.tokens[done:]
            st.tokens.extend(r.token_ids[done:done + n])
            chunks.append(SeqChunk(r.request_id, st.tokens, done, n, False))
        uniforms = {i: self._uniforms(requests[i], max_tokens[i]) for i in live
                    if not requests[i].sampling_params.is_greedy}
        for _ in range(max(max_tokens[i] for i in live) if live else 0):
            drafted = self._step(requests, live, chunks, out, uniforms)
            chunks = []
            next_live = []
            for i, token in zip(live, drafted, strict=True):
                out[i].append(token)
                state = requests[i].proposer_state
                assert isinstance(state, DraftState)
                if len(out[i]) < max_tokens[i]:  # its KV is needed: compute it next step
                    state.tokens.append(token)
                    chunks.append(SeqChunk(requests[i].request_id, state.tokens,
                                           len(state.tokens) - 1, 1, True))
                    next_live.append(i)
            live = next_live
        if chunks and not live:  # catch-up chunks alone (no request drafts this time)
            self.runner.execute(build_step(self.kv, chunks))
        return out

    def _state(self, r: Request) -> DraftState:
        st = r.proposer_state
        if isinstance(st, DraftState) and r.request_id in self.kv.block_tables:
            return st
        fresh = DraftState()
        r.proposer_state = fresh
        return fresh

    def _allocate(self, r: Request, num_tokens: int, done: int) -> bool:
        """Blocks for ``num_tokens`` of ``r``'s tokens; none left: its draft state is
        dropped (it catches up again later)."""
        if self.kv.allocate_slots(r.request_id, num_tokens, num_computed_tokens=done):
            return True
        self.kv.free(r.request_id)
        r.proposer_state = None
        return False

    def _uniforms(self, r: Request, n: int) -> np.ndarray:
        """The uniforms of ``r``'s next ``n`` output tokens: its random stream's next numbers
        (the engine's stream for the sequence, which verification draws from)."""
        gen = getattr(r.engine_state, "generator", None)
        if not isinstance(gen, np.random.Generator):
            st = r.proposer_state
            assert isinstance(st, DraftState)
            if st.generator is None:
                st.generator = make_generator(r.sampling_params.seed)
            gen = st.generator
        return peek_uniforms(gen, n)

    def _sampler(self, r: Request) -> Sampler:
        key = (tuple(r.eos_token_ids), self.coupled)
        if key not in self._samplers:
            self._samplers[key] = Sampler(self.vocab_size, key[0], coupled=self.coupled)
        return self._samplers[key]

    def _step(self, requests: Sequence[Request], live: list[int], chunks: list[SeqChunk],
              out: list[list[int]], uniforms: dict[int, np.ndarray]) -> list[int]:
        """One draft step over ``chunks``: each live request's next draft token, picked as
        the target's sampler would pick it (``out[i]``: its drafts so far)."""
        step = build_step(self.kv, chunks)
        rows = [SamplingRow(requests[i].sampling_params, requests[i].prompt_token_ids,
                            [*requests[i].output_token_ids, *out[i]], _NO_STREAM)
                for i in live]
        if all(self._sampler(requests[i]).is_plain_greedy(row.params,
                                                          len(row.output_token_ids))
               for i, row in zip(live, rows, strict=True)):
            return [int(t) for t in self.runner.execute_argmax(step)]
        logits = self.runner.execute(step)
        tokens = []
        for row_index, (i, row) in enumerate(zip(live, rows, strict=True)):
            u = uniforms[i][len(out[i])] if i in uniforms else 0.0
            tokens.append(self._sampler(requests[i]).draw(
                logits[row_index:row_index + 1], [row], [u])[0])
        return tokens

    def retain(self, running: set[str]) -> None:
        """Free the blocks of every request that no longer runs."""
        for rid in [rid for rid in self.kv.block_tables if rid not in running]:
            self.kv.free(rid)

    def close(self) -> None:
        self.runner.close()


# Rows handed to Sampler.draw carry a generator it never reads.
_NO_STREAM = np.random.Generator(np.random.PCG64(0))


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
