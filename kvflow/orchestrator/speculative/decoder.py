"""The engine's speculative decoding: drafts after a step, verification in the next. Pure
Python and NumPy.

:class:`SpeculativeDecoder` is the one object :class:`~kvflow.orchestrator.engine.LLMEngine`
holds for it. After each step, :meth:`SpeculativeDecoder.propose` asks the proposer for drafts
for every request about to decode, cuts each where its grammar would refuse it, and lets the
:class:`~kvflow.orchestrator.speculative.draft_length.DraftLengthPolicy` decide how many each
keeps (``Request.spec_token_ids``). The scheduler schedules them with the decode, the runner
scores every position, and :meth:`SpeculativeDecoder.verify` turns each sequence's logits into
the tokens it emits (:mod:`~kvflow.orchestrator.speculative.verification`).

Cutting a draft at the first token its grammar refuses leaves verification lossless: the
token emitted at each position is the target's own draw, whatever the drafts were.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from kvflow.orchestrator.request import Request, RequestStatus
from kvflow.orchestrator.sampling.kernels import logprobs_of
from kvflow.orchestrator.sampling.sampler import Sampler, SamplingRow
from kvflow.orchestrator.speculative.draft_length import DraftLengthPolicy
from kvflow.orchestrator.speculative.proposers import Proposer
from kvflow.orchestrator.speculative.verification import accept_greedy, verify

# Per token: token id -> log-probability (the token's and the top ``logprobs``').
LogprobEntry = dict[int, float]


# The draft tokens of one proposal when the engine gives no budget: EngineOptions'
# max_num_batched_tokens default.
DEFAULT_TOKEN_BUDGET = 2048


class SpeculativeDecoder:
    """Proposes drafts for the running requests and verifies them.

    Args:
        proposer: drafts the tokens.
        max_drafts: the most drafts of one request per step (``num_speculative_tokens``).
        dynamic: the draft length from the cost model (else always the most drafted).
        token_budget: the most tokens a draft model computes in one of its steps (a
            request's catch-up with its prompt is chunked under it), unless
            :meth:`propose` is given the step's own; the engine's
            ``max_num_batched_tokens``.
    """

    def __init__(self, proposer: Proposer, max_drafts: int, dynamic: bool = True,
                 token_budget: int = DEFAULT_TOKEN_BUDGET) -> None:
        if token_budget < 1:
            raise ValueError(f"token_budget must be >= 1, got {token_budget}")
        self.proposer = proposer
        self.max_drafts = max_drafts
        self.token_budget = token_budget
        self.policy = DraftLengthPolicy(max_drafts, dynamic=dynamic)

    def propose(self, running: Sequence[Request], num_other_tokens: int = 0,
                token_budget: int | None = None) -> None:
        """Draft tokens for each running request whose next step is a decode and that lets
        the engine speculate, as many as the policy grants (none: it decodes plainly).

        ``token_budget``: the step's token budget (the scheduler's), which bounds the draft
        model's steps (None: the one given at construction)."""
        budget = self.token_budget if token_budget is None else max(int(token_budget), 1)
        self.proposer.retain({r.request_id for r in running})
        requests, rooms = [], []
        for r in running:
            if (r.status != RequestStatus.RUNNING or not r.sampling_params.speculative
                    or r.num_tokens - r.num_computed_tokens != 1):
                continue
            # At most the output still allowed: the drafts and the token verification adds.
            room = min(self.max_drafts, r.max_output_tokens - r.num_output_tokens - 1)
            if room > 0:
                requests.append(r)
                rooms.append(room)
        if not requests:
            return
        chosen: list[tuple[Request, list[int]]] = []
        for r, drafts in zip(requests, self.proposer.propose(requests, rooms, budget), strict=True):
            state = r.engine_state
            if drafts and state is not None and state.grammar is not None:
                drafts = drafts[:state.grammar.num_valid(drafts)]
            if drafts:
                chosen.append((r, drafts))
        if not chosen:
            return
        lengths = self.policy.lengths([r for r, _ in chosen], [len(d) for _, d in chosen],
                                      num_other_tokens)
        for (r, drafts), k in zip(chosen, lengths, strict=True):
            r.spec_token_ids = drafts[:k]

    def observe_step(self, num_tokens: int, step_time_s: float) -> None:
        """Every step's size and duration, for the policy's step-time fit."""
        self.policy.observe_step(num_tokens, step_time_s)

    def verify(self, sampler: Sampler, requests: Sequence[Request], drafts: Sequence[list[int]],
               logits: Sequence[np.ndarray] | None, greedy: Sequence[np.ndarray] | None,
               sampling_row: Callable[[Request], SamplingRow]
               ) -> tuple[list[list[int]], list[list[LogprobEntry] | None]]:
        """The tokens each request emits, given its drafts and the logits of their positions
        (``logits[i]``: ``[len(drafts[i]) + 1, vocab]``), or only their argmax (``greedy``,
        every request plain greedy); and per request that asked, each token's logprobs."""
        if self.proposer.coupled and not sampler.coupled:
            raise ValueError(f"the {self.proposer.name!r} proposer draws its drafts by the race: "
                             "the engine's sampler must too (Sampler.coupled)")
        tokens: list[list[int]] = []
        entries: list[list[LogprobEntry] | None] = []
        for i, (request, draft) in enumerate(zip(requests, drafts, strict=True)):
            if logits is None:
                assert greedy is not None
                out = accept_greedy(greedy[i].tolist(), draft)
            else:
                row = sampling_row(request)
                state = request.engine_state
                grammar = state.grammar if state is not None else None
                masks = grammar.masks_along(draft) if grammar is not None else None
                out = verify(sampler, logits[i], row, draft, masks)
            self.policy.observe_verification(len(draft), len(out) - 1)
            tokens.append(out)
            want = request.sampling_params.logprobs
            if want is None or logits is None:
                entries.append(None)
                continue
            raw = np.asarray(logits[i][:len(out), :sampler.vocab_size], dtype=np.float32)
            values, tops = logprobs_of(raw, out, [want] * len(out))
            entries.append([{**dict(top), token: value}
                            for token, value, top in zip(out, values, tops, strict=True)])
        return tokens, entries
