"""Proposers: who drafts the tokens a step verifies. Pure Python.

A :class:`Proposer` looks at one request's tokens (prompt and output so far) and drafts up to
``k`` tokens that may follow. Its per-request state lives on the request
(``Request.proposer_state``), so it ends with the request and nothing is kept for requests
that are gone. Proposers by name: :data:`PROPOSERS`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

from kvflow.orchestrator.request import Request


class Proposer(ABC):
    """Drafts tokens for one request at a time. Verification is lossless whatever the drafts
    are (:mod:`~kvflow.orchestrator.speculative.verification`): a proposer only decides how
    many are accepted.

    ``coupled``: its drafts are drawn by the race
    (:mod:`~kvflow.orchestrator.sampling.race`) with the request's uniforms, so the engine's
    sampler must draw by the race too (``Sampler.coupled``), or they are rarely accepted."""

    name = ""
    coupled = False

    @abstractmethod
    def propose(self, requests: Sequence[Request], max_tokens: Sequence[int],
                token_budget: int | None = None) -> list[list[int]]:
        """For each request, up to ``max_tokens[i]`` tokens that may follow its
        ``token_ids`` (maybe none). ``token_budget``: the most tokens a model computes in one
        step for it (a draft model's; None: unbounded)."""

    def retain(self, running: set[str]) -> None:  # noqa: B027  (most hold nothing)
        """After each step: the requests that still run (by id); what the proposer holds for
        any other (a draft model's KV blocks) is released."""

    def close(self) -> None:  # noqa: B027  (most hold nothing)
        """Release what the proposer holds (a draft model's runner)."""


class NgramIndex:
    """Where each n-gram of a token sequence last ended, for n in ``[min_n, max_n]``, over
    every position but the last; grown as the sequence grows. The state of one request."""

    __slots__ = ("min_n", "max_n", "ends", "num_indexed")

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.ends: list[dict[tuple[int, ...], int]] = [{} for _ in range(max_n - min_n + 1)]
        self.num_indexed = 0  # n-grams ending at positions below this are indexed

    def extend(self, tokens: Sequence[int]) -> None:
        """Index the n-grams ending before the sequence's last position."""
        last = len(tokens) - 1
        for end in range(self.num_indexed, last):
            for i, n in enumerate(range(self.min_n, self.max_n + 1)):
                if end + 1 >= n:
                    self.ends[i][tuple(tokens[end + 1 - n:end + 1])] = end
        self.num_indexed = max(self.num_indexed, last)

    def match(self, tokens: Sequence[int]) -> int | None:
        """Where the longest n-gram ending at the sequence's last position last ended before
        it (the most recent match), or None."""
        last = len(tokens) - 1
        for i in range(len(self.ends) - 1, -1, -1):
            n = self.min_n + i
            if last + 1 < n:
                continue
            end = self.ends[i].get(tuple(tokens[last + 1 - n:last + 1]))
            if end is not None:
                return end
        return None


class NgramProposer(Proposer):
    """Prompt lookup: match the last ``n`` tokens (the longest ``n`` in ``[min_n, max_n]``
    that matches) against the prompt and the output so far, and propose the tokens that
    followed the most recent match. No second model; at home where the output repeats the
    prompt (editing code, quoting a document) and in repetitive output."""

    name = "ngram"

    def __init__(self, min_n: int = 2, max_n: int = 5) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"ngram sizes must satisfy 1 <= min_n <= max_n, got {min_n}, "
                             f"{max_n}")
        self.min_n, self.max_n = min_n, max_n

    def propose(self, requests: Sequence[Request], max_tokens: Sequence[int],
                token_budget: int | None = None) -> list[list[int]]:
        return [self._propose(r, k) for r, k in zip(requests, max_tokens, strict=True)]

    def _propose(self, request: Request, max_tokens: int) -> list[int]:
        index = request.proposer_state
        if not isinstance(index, NgramIndex):
            index = request.proposer_state = NgramIndex(self.min_n, self.max_n)
        tokens = request.token_ids
        index.extend(tokens)
        end = index.match(tokens)
        if end is None or max_tokens <= 0:
            return []
        return tokens[end + 1:end + 1 + max_tokens]


# Proposers by the name EngineOptions.speculative takes that need nothing but the request
# ("draft" is made by the engine's loader, which opens the draft engine).
PROPOSERS: dict[str, type[Proposer]] = {"ngram": NgramProposer}


def make_proposer(name: str) -> Proposer:
    """The proposer called ``name``, refusing one that needs more than its name."""
    if name not in PROPOSERS:
        raise ValueError(f"speculative={name!r} needs its proposer made by the engine's "
                         f"loader (a draft model's engine); by name alone: {sorted(PROPOSERS)}")
    return PROPOSERS[name]()
