"""The step's token budget from a target step time (``max_step_ms``). Pure Python.

A decode stream's gap between tokens is one engine step, so a step bounded in time bounds
every stream's inter-token latency, whatever arrives beside it (Sarathi-Serve's stall-free
batching: the decodes first, then prefill chunks in what the budget leaves). A token count
alone does not: 2,048 tokens of a long prompt take seconds on a CPU.

:class:`StepBudget` turns the target into tokens from the runner's measured cost. The engine
reports each step's tokens and duration (:meth:`~kvflow.orchestrator.scheduler.core.Scheduler
.observe_step`, from its step statistics; the simulator's engine does so on simulated time),
and the budget fits ``t(n) = fixed_s + per_token_s * n`` by least squares over the recent
steps, exponentially forgotten (half-life ``HALF_LIFE_STEPS``), so it follows the cost as it
changes (longer contexts, prompt logprobs, a busier machine). The next step's budget is then
``(target - fixed_s) / per_token_s``, within ``[1, max_num_batched_tokens]``; where the fixed
cost alone nears or passes the target (a slow or busy machine: no budget meets it), the tokens
may still add ``MIN_CHUNK_SHARE`` of it (of the target, at most), so that prompts advance at a
useful rate while the decodes slow by at most half the target.

The first step is not measured (``WARMUP_STEPS``: a runner's lazy setup), and a step's time
counts for at most ``OUTLIER_FACTOR`` times its prediction (a pause of the collector or the OS
is no cost per token; a machine that did slow down shows it over a few steps).

Until the fit is known the budget is cautious: the first step plans ``FIRST_STEP_TOKENS``;
while the steps measured do not vary enough in size to separate the fixed cost from the cost
per token, the whole step time is charged to its tokens (an overestimate of the cost per
token, so a smaller budget), but never below ``FIRST_STEP_TOKENS``, the step that will vary
them (decodes alone, one token each, would otherwise leave a prompt a token a step on a slow
machine, forever); and the budget never plans a step more than ``GROWTH`` times the largest
one measured, so an extrapolated fit cannot plan a step of seconds. Once known,
the fit follows steps that stop varying in size (a long prompt alone, chunk after chunk, its
attention costlier with each) through its fixed cost, keeping its cost per token.

Which runner gets which target by default: :func:`default_max_step_ms`.
"""

from __future__ import annotations

HALF_LIFE_STEPS = 32
# The first step's budget, before anything was measured.
FIRST_STEP_TOKENS = 32
# The most a planned step may exceed the largest step measured, as a factor.
GROWTH = 2
# Steps not measured at first (a runner's first step pays for its lazy setup), and the most
# a step's time counts for, as a multiple of its prediction (a pause is not a cost per token).
WARMUP_STEPS = 1
OUTLIER_FACTOR = 4.0
# The least time a step's tokens may add, as a share of its fixed cost (or of the target).
MIN_CHUNK_SHARE = 0.5
# The spread of step sizes (standard deviation, tokens) a fit needs to be trusted.
MIN_SPREAD_TOKENS = 2.0
# The runners that compute on the CPU, where one large step takes seconds: their default
# target. GPU runners and the simulator default to no time bound (the token budget alone).
CPU_RUNNERS = ("onnxruntime", "torch")
CPU_DEFAULT_MAX_STEP_MS = 200.0


def default_max_step_ms(runner_name: str) -> float:
    """``max_step_ms`` when the options leave it unset (None): 200 ms on the CPU runners, 0
    (no time bound) on the GPU runners, whose steps stay short under the token budget, and in
    the simulator, which runs the token budget alone unless given a target."""
    return CPU_DEFAULT_MAX_STEP_MS if runner_name in CPU_RUNNERS else 0.0


class StepBudget:
    """The token budget of the next step for a target step time, from measured steps.

    Args:
        target_s: the target step time in seconds (> 0).
        max_tokens: the upper bound (``max_num_batched_tokens``).
    """

    def __init__(self, target_s: float, max_tokens: int) -> None:
        if not target_s > 0:
            raise ValueError(f"target_s must be > 0, got {target_s}")
        self.target_s = target_s
        self.max_tokens = max_tokens
        self._decay = 0.5 ** (1.0 / HALF_LIFE_STEPS)
        self._sums = [0.0] * 5  # weight, n, n^2, t, n t
        self.largest_step = 0  # tokens of the largest step measured
        self.fit: tuple[float, float] | None = None  # (fixed_s, per_token_s)
        self._ratio = 0.0  # seconds per token, the whole step charged to its tokens
        self.num_observed = 0

    def observe(self, num_tokens: int, step_time_s: float) -> None:
        """One step of ``num_tokens`` tokens took ``step_time_s`` seconds."""
        if num_tokens <= 0 or not step_time_s > 0:
            return
        self.num_observed += 1
        if self.num_observed <= WARMUP_STEPS:
            return  # a runner's first step pays for its lazy setup
        if self.fit is not None:
            # A pause (the collector, the OS) says nothing about the cost per token; a
            # machine that did slow down shows it over a few steps. (Not against the whole
            # step charged to its tokens: that predicts a small step far too short.)
            step_time_s = min(step_time_s, OUTLIER_FACTOR * self.predict_s(num_tokens))
        d, s = self._decay, self._sums
        for i, v in enumerate((1.0, num_tokens, num_tokens * num_tokens, step_time_s,
                               num_tokens * step_time_s)):
            s[i] = s[i] * d + v
        self.largest_step = max(self.largest_step, num_tokens)
        w, sn, snn, st, snt = s
        mean_n, mean_t = sn / w, st / w
        var = snn / w - mean_n * mean_n
        if var >= MIN_SPREAD_TOKENS ** 2:
            per_token = (snt / w - mean_n * mean_t) / var
            if per_token > 0:
                # NOTE: noise may put the line's intercept below 0 or above the mean time.
                fixed = min(max(mean_t - per_token * mean_n, 0.0), mean_t)
                self.fit = (fixed, per_token)
                return
        if self.fit is None:
            # No spread yet (or no slope): the whole step charged to its tokens.
            self._ratio = mean_t / mean_n
            return
        # Steps of one size (a long prompt alone, chunk after chunk) cannot refit the slope,
        # but their time still moves (attention over a growing context): the fit keeps its cost
        # per token and follows their mean time with its fixed cost.
        fixed = mean_t - self.fit[1] * mean_n
        self.fit = (fixed, self.fit[1]) if fixed >= 0 else (0.0, mean_t / mean_n)

    def predict_s(self, num_tokens: int) -> float:
        """The predicted time of a step of ``num_tokens`` tokens (0: nothing measured)."""
        if self.fit is not None:
            return self.fit[0] + self.fit[1] * num_tokens
        return self._ratio * num_tokens

    @property
    def per_token_s(self) -> float | None:
        """The cost per token the budget divides by (None: nothing measured yet)."""
        if self.fit is not None:
            return self.fit[1]
        return self._ratio or None

    @property
    def tokens(self) -> int:
        """The budget of the next step, in ``[1, max_tokens]``."""
        explore = max(1, min(self.max_tokens, FIRST_STEP_TOKENS))
        if self.fit is None and self._ratio == 0:
            return explore
        cap = min(self.max_tokens, max(FIRST_STEP_TOKENS, GROWTH * self.largest_step))
        if self.fit is None:
            # Steps of one size, decodes alone most often, cannot tell a fixed cost from a cost
            # per token; charged whole to its tokens, a slow decode would leave prompts a
            # token a step, and nothing would ever vary: a step of FIRST_STEP_TOKENS at least
            # is what measures the difference.
            return max(explore, min(cap, int(self.target_s / self._ratio + 1e-6)))
        fixed, per_token = self.fit
        # The tokens may always add MIN_CHUNK_SHARE of a bare step's time (of the target, at
        # most: a transient overestimate of the fixed cost must not plan a long step): where
        # the fixed cost alone nears or passes the target, which no budget can then meet,
        # prompts still advance at a useful rate.
        chunk_s = max(self.target_s - fixed, MIN_CHUNK_SHARE * min(fixed, self.target_s))
        # NOTE: the epsilon keeps an exact quotient (95.0 computed as 94.999...) whole.
        return max(1, min(cap, int(chunk_s / per_token + 1e-6)))
