"""How many drafts each request gets: a cost model of the step against the acceptance rate.
Pure Python.

Speculation pays when the step's time grows more slowly with its tokens than the output grows
with the accepted drafts. Both sides are measured:

* **The step.** ``t(n) = a + b n`` seconds for a step of ``n`` decode and draft tokens (the
  engine reports its steps without prefill chunks, whose large matmuls run other kernels, and
  times each with the drafting of the next step's tokens: a draft model's cost is in ``b``),
  fitted by least squares over the recent steps (exponentially forgotten, half-life
  ``HALF_LIFE_STEPS``). The steps vary in ``n`` by themselves (drafts of varying length, the
  batch coming and going), which is what identifies ``b``; until they do, every request
  drafts the most it may (the optimistic start that produces the varied steps), and a fit
  stays in force while new steps do not vary enough to replace it.
* **The acceptance.** Each draft position is accepted with a probability ``alpha`` per
  request, geometric: the maximum-likelihood ``alpha`` of a request is its accepted drafts over
  accepted drafts plus rejections, with ``PRIOR_WEIGHT`` pseudo-drafts at the rate of every
  request so far.

The choice is greedy over marginal gains. With ``B`` decodes the step yields ``E = B`` tokens
in ``T = t(B + other)``; a request's ``j``-th draft adds ``alpha**j`` expected tokens and ``b``
seconds, and is worth it when it raises ``E / T``: ``alpha**j * T > b * E``. Drafts are taken
largest gain first while that holds. At a large batch ``b E / T`` nears 1 and nothing passes:
speculation turns itself off at load, and back on when the load falls.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from kvflow.orchestrator.request import Request

HALF_LIFE_STEPS = 200
PRIOR_WEIGHT = 4.0
# The spread of step sizes (standard deviation, tokens) a fit needs to be trusted.
MIN_SPREAD_TOKENS = 1.0


class DraftLengthPolicy:
    """The draft length per request and step, from the fitted step time and the acceptance.

    ``max_drafts``: the most drafts of one request in one step (``num_speculative_tokens``);
    ``dynamic=False``: always the most drafted, whatever the cost (the fixed draft length, a
    baseline).
    """

    def __init__(self, max_drafts: int, prior_acceptance: float = 0.5,
                 dynamic: bool = True) -> None:
        self.max_drafts = max_drafts
        self.dynamic = dynamic
        self._decay = 0.5 ** (1.0 / HALF_LIFE_STEPS)
        self._sums = [0.0] * 5  # weight, n, n^2, t, n t
        self.fit: tuple[float, float] | None = None  # (a, b) seconds, seconds per token
        self.accepted, self.rejections = prior_acceptance * PRIOR_WEIGHT, (
            (1 - prior_acceptance) * PRIOR_WEIGHT)

    # --- what is measured ---------------------------------------------------------------------
    def observe_step(self, num_tokens: int, step_time_s: float) -> None:
        """One step's size and duration."""
        d, s = self._decay, self._sums
        for i, v in enumerate((1.0, num_tokens, num_tokens * num_tokens, step_time_s,
                               num_tokens * step_time_s)):
            s[i] = s[i] * d + v
        w, sn, snn, st, snt = s
        var = snn / w - (sn / w) ** 2
        if var >= MIN_SPREAD_TOKENS ** 2:
            b = max((snt / w - sn / w * st / w) / var, 0.0)
            a = max(st / w - b * sn / w, 1e-6)
            self.fit = (a, b)

    def observe_verification(self, num_drafts: int, num_accepted: int) -> None:
        """One request's verified drafts (every request's pool the prior of each)."""
        self.accepted += num_accepted
        self.rejections += num_accepted < num_drafts

    @property
    def acceptance(self) -> float:
        """Every request's acceptance so far (the prior of a new request's)."""
        return self.accepted / (self.accepted + self.rejections)

    def acceptance_of(self, request: Request) -> float:
        """A request's own acceptance, shrunk toward every request's."""
        acc = request.num_accepted_tokens + PRIOR_WEIGHT * self.acceptance
        return acc / (acc + request.num_spec_rejections + PRIOR_WEIGHT * (1 - self.acceptance))

    # --- the choice ---------------------------------------------------------------------------
    def lengths(self, requests: Sequence[Request], available: Sequence[int],
                num_other_tokens: int = 0) -> list[int]:
        """How many drafts each of ``requests`` (the decodes of the next step) keeps, of the
        ``available`` its proposer drafted; ``num_other_tokens``: the step's other tokens
        (prefill chunks), as expected."""
        if self.fit is None or not self.dynamic:
            return [min(n, self.max_drafts) for n in available]
        a, b = self.fit
        gains = 0.0 + len(requests)
        time_s = a + b * (len(requests) + num_other_tokens)
        out = [0] * len(requests)
        alphas = [self.acceptance_of(r) for r in requests]
        # A max-heap of each request's next draft's gain, alpha ** j.
        heap = [(-alpha, i) for i, alpha in enumerate(alphas) if available[i] > 0]
        heapq.heapify(heap)
        while heap:
            neg_gain, i = heapq.heappop(heap)
            gain = -neg_gain
            if gain * time_s <= b * gains:
                break
            out[i] += 1
            gains += gain
            time_s += b
            if out[i] < min(available[i], self.max_drafts):
                heapq.heappush(heap, (-gain * alphas[i], i))
        return out
