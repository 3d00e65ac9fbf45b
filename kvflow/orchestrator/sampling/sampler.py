"""Pick the next token of every row of a batch from the model's logits, with numpy.

Order of operations per row (vLLM's):

1. log-probabilities, when requested, from the *raw* logits (log_softmax of the model output);
2. penalties: repetition (HF, over prompt + output), then frequency and presence (OpenAI, over
   the output only);
3. ``min_tokens``: until that many tokens exist, EOS (unless ``ignore_eos``) and
   ``stop_token_ids`` are masked to -inf; a structured output's row instead has every token its
   grammar does not allow masked (:func:`~kvflow.orchestrator.sampling.structured.apply_bitmask`,
   one pass over the constrained rows);
4. greedy rows take the argmax (ties go to the lowest token id);
5. other rows: divide by the temperature, keep top_k, then top_p (of the top-k renormalised
   distribution), then min_p, and invert the CDF of the softmax at ONE uniform draw from the
   row's own generator (or, ``coupled``, run the race keyed by that draw:
   :mod:`~kvflow.orchestrator.sampling.race`, for speculative decoding with a draft model).

Reproducibility: everything a row's token depends on is computed from that row alone (numpy's
row-wise reductions, selections and sorts do not look at neighbouring rows), and each row draws
exactly one number per step from its own generator. So a seeded request yields the same tokens
whatever else is in the batch and wherever its row is. Speculative decoding keeps this: a
sequence's ``i``-th output token is always the token this sampler picks with the ``i``-th
number of its stream (:meth:`Sampler.draw`; see
:mod:`~kvflow.orchestrator.speculative.verification`), however many drafts it had.

Cost (256 rows x 49152 vocab, one core): an all-greedy batch without penalties is one argmax pass;
otherwise only the rows that need it are copied, top_k uses ``argpartition`` rather than a sort,
top_p sorts only a top-1024 candidate set unless that set holds less than top_p of the mass, and
the CDF is inverted over 256-wide blocks so no full-row cumulative sum is needed. Those row
kernels are in :mod:`kvflow.orchestrator.sampling.kernels`; this module picks the rows' paths.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvflow.orchestrator.sampling.kernels import (
    apply_bans,
    apply_penalties,
    argmax_rows,
    logprobs_of,
    sample_dense,
    sample_dense_race,
    sample_top_k,
    sample_top_p,
)
from kvflow.orchestrator.sampling.params import MAX_SEED, SamplingParams
from kvflow.orchestrator.sampling.race import race_keys
from kvflow.orchestrator.sampling.structured import apply_bitmask

# Row categories, in the order the work matrix is laid out (each one is a contiguous slice).
_DENSE, _TOP_K, _TOP_P, _GREEDY_MODIFIED = range(4)


def make_generator(seed: int | None) -> np.random.Generator:
    """The random stream of one request: seeded if ``seed`` is given, else from OS entropy.

    Create it once per request and keep it for the request's lifetime; the sampler draws
    exactly one number from it per step (for non-greedy requests).
    """
    if seed is not None:
        if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
            raise TypeError(f"seed must be an int or None, got {seed!r} ({type(seed).__name__})")
        if not 0 <= seed <= MAX_SEED:
            raise ValueError(f"seed must be in [0, 2**63 - 1], got {seed}")
        seed = int(seed)
    return np.random.Generator(np.random.PCG64(seed))


@dataclass
class SamplingRow:
    """What the sampler needs to know about one request for one step.

    Token-id sequences may be lists or integer numpy arrays (arrays avoid a conversion).
    """

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    generator: np.random.Generator
    # A structured output's allowed next tokens: int32 [ceil(vocab / 32)], bit t of word
    # t // 32 set for an allowed token (llguidance's layout); None: unconstrained.
    bitmask: np.ndarray | None = None


@dataclass
class SamplerOutput:
    """One step's result, one entry per row.

    Attributes:
        token_ids: The sampled token of each row.
        logprobs: Log-probability (raw logits) of the sampled token, or None when the row's
            ``params.logprobs`` is None.
        top_logprobs: The ``params.logprobs`` most likely (token id, log-probability) pairs,
            most likely first (ties: lower id first), or None when not requested.
    """

    token_ids: list[int]
    logprobs: list[float | None]
    top_logprobs: list[list[tuple[int, float]] | None]


class Sampler:
    """Samples one next token per row of a batch of logits.

    Args:
        vocab_size: Number of real tokens; logits columns past it (padding) are never sampled.
        eos_token_ids: Ids masked while a row is below its ``min_tokens`` (unless
            ``ignore_eos``).
        coupled: draw each row's token by the race keyed by its uniform
            (:mod:`~kvflow.orchestrator.sampling.race`) rather than the inverse CDF: the same
            distribution, other tokens; for an engine whose draft model drafts with the race.
    """

    def __init__(self, vocab_size: int, eos_token_ids: Sequence[int],
                 coupled: bool = False) -> None:
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, numbers.Integral):
            raise TypeError(f"vocab_size must be an int, got {vocab_size!r}")
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        eos = tuple(int(t) for t in eos_token_ids)
        for t in eos:
            if not 0 <= t < vocab_size:
                raise ValueError(f"eos_token_ids must be in [0, {vocab_size}), got {t}")
        self.vocab_size: int = int(vocab_size)
        self.eos_token_ids: tuple[int, ...] = eos
        self.coupled: bool = bool(coupled)

    # ------------------------------------------------------------------ public

    def sample(self, logits: np.ndarray, rows: Sequence[SamplingRow]) -> SamplerOutput:
        """Sample one token for each row.

        Args:
            logits: float array [len(rows), >= vocab_size]; it is not modified.
            rows: Per-row parameters and state, in the order of ``logits``' rows.

        Returns:
            The sampled tokens and, for rows that asked, their log-probabilities.
        """
        x = self._valid_logits(logits, len(rows))
        token_list = self._tokens(x, rows, None)
        logprobs, top_logprobs = self._logprobs(x, rows, token_list)
        return SamplerOutput(token_ids=token_list, logprobs=logprobs, top_logprobs=top_logprobs)

    def draw(self, logits: np.ndarray, rows: Sequence[SamplingRow],
             uniforms: Sequence[float] | np.ndarray) -> list[int]:
        """The token :meth:`sample` would pick for each row had the row's generator drawn
        ``uniforms[i]`` (greedy rows ignore theirs); no generator is touched, no logprobs.

        Speculative decoding's one way to sample: verification draws every draft position
        with the uniform the request's stream holds for it, and a draft model its drafts with
        the same uniforms, so both go through these very filters (top-k, top-p, min-p) and
        inverse CDF."""
        if len(uniforms) != len(rows):
            raise ValueError(f"uniforms: one per row ({len(rows)}), got {len(uniforms)}")
        x = self._valid_logits(logits, len(rows))
        return self._tokens(x, rows, np.asarray(uniforms, dtype=np.float64))

    def _tokens(self, x: np.ndarray, rows: Sequence[SamplingRow],
                uniforms: np.ndarray | None) -> list[int]:
        """Each row's token; ``uniforms``: each row's draw (None: from its generator)."""
        n = len(rows)
        tokens = np.empty(n, dtype=np.int64)

        plain: list[int] = []  # greedy, logits untouched: argmax straight on the input
        work_keys: list[tuple[int, int, int]] = []  # (category, top_k, row) of rows to copy
        bans: dict[int, np.ndarray] = {}
        for i, row in enumerate(rows):
            p = row.params
            constrained = row.bitmask is not None
            ban = self._row_ban(row)
            if ban is not None:
                bans[i] = ban
            if p.is_greedy:
                if p.has_penalties or ban is not None or constrained:
                    work_keys.append((_GREEDY_MODIFIED, 0, i))
                else:
                    plain.append(i)
            elif 0 < p.top_k < self.vocab_size:
                work_keys.append((_TOP_K, p.top_k, i))
            elif p.top_p < 1.0:
                work_keys.append((_TOP_P, 0, i))
            else:
                work_keys.append((_DENSE, 0, i))

        if plain:
            tokens[plain] = argmax_rows(x, plain)
        if work_keys:
            self._sample_work_rows(x, rows, sorted(work_keys), bans, tokens, uniforms)
        token_list: list[int] = tokens.tolist()
        return token_list

    def is_plain_greedy(self, params: SamplingParams, num_output_tokens: int) -> bool:
        """Whether a row's token is the argmax of its raw logits and nothing else is read from
        them (no penalties, no ``min_tokens`` ban, no logprobs): the runner may then return
        the argmax alone (:meth:`ModelRunner.execute_argmax`)."""
        return (params.is_greedy and not params.has_penalties and params.logprobs is None
                and params.structured is None
                and self._min_tokens_ban(params, num_output_tokens) is None)

    def processed_logits(self, logits: np.ndarray, rows: Sequence[SamplingRow]) -> np.ndarray:
        """The logits after penalties, ``min_tokens`` and grammar masking, before temperature.

        A float32 copy [len(rows), vocab_size] of every row, for tests and debugging;
        :meth:`sample` applies the same steps, but only to the rows that need them.
        """
        x = self._valid_logits(logits, len(rows))
        work = np.array(x, dtype=np.float32)
        self._apply_penalties(work, list(rows))
        apply_bans(work, [self._row_ban(r) for r in rows])
        self._apply_bitmasks(work, rows)
        return work

    # --------------------------------------------------------------- internals

    def _valid_logits(self, logits: np.ndarray, num_rows: int) -> np.ndarray:
        if not isinstance(logits, np.ndarray):
            raise TypeError(f"logits must be a numpy array, got {type(logits).__name__}")
        if logits.ndim != 2 or logits.shape[0] != num_rows:
            raise ValueError(
                f"logits must have shape [num_rows={num_rows}, vocab], got {logits.shape}"
            )
        if logits.shape[1] < self.vocab_size:
            raise ValueError(
                f"logits must have at least vocab_size={self.vocab_size} columns, "
                f"got {logits.shape[1]}"
            )
        if not np.issubdtype(logits.dtype, np.floating):
            raise TypeError(f"logits must be a float array, got dtype {logits.dtype}")
        return logits[:, :self.vocab_size]  # type: ignore[index]  # a view: padding drops out

    def _row_ban(self, row: SamplingRow) -> np.ndarray | None:
        """The ids a row may not sample this step: a grammar decides when a constrained row
        may end, so min_tokens bans EOS only in unconstrained ones."""
        if row.bitmask is not None:
            return None
        return self._min_tokens_ban(row.params, len(row.output_token_ids))

    @staticmethod
    def _apply_bitmasks(work: np.ndarray, rows: Sequence[SamplingRow]) -> None:
        """Mask what their grammars disallow in the constrained rows, in one pass."""
        masked = [j for j, r in enumerate(rows) if r.bitmask is not None]
        if masked:
            masks = [rows[j].bitmask for j in masked]
            apply_bitmask(work, np.stack(masks), rows=masked)  # type: ignore[arg-type]

    def _min_tokens_ban(self, p: SamplingParams, num_output_tokens: int) -> np.ndarray | None:
        if num_output_tokens >= p.min_tokens:
            return None
        ids = list(p.stop_token_ids)
        if not p.ignore_eos:
            ids.extend(self.eos_token_ids)
        # Ids past the vocabulary cannot be sampled anyway.
        ban = np.asarray([t for t in ids if t < self.vocab_size], dtype=np.int64)
        return ban if ban.size else None

    def _sample_work_rows(
        self,
        x: np.ndarray,
        rows: Sequence[SamplingRow],
        keys: list[tuple[int, int, int]],
        bans: dict[int, np.ndarray],
        tokens: np.ndarray,
        uniforms: np.ndarray | None = None,
    ) -> None:
        """Copy the rows that need changing into one matrix, laid out by category, and sample."""
        order = [i for _, _, i in keys]
        # The single copy of the logits this step makes: only the rows that are modified.
        work = np.asarray(x[order], dtype=np.float32)
        self._apply_penalties(work, [rows[i] for i in order])
        apply_bans(work, [bans.get(i) for i in order])
        self._apply_bitmasks(work, [rows[i] for i in order])

        # Contiguous [start, stop) slices per (category, top_k) group; slices are views.
        start = 0
        while start < len(keys):
            category, top_k = keys[start][:2]
            stop = start
            while stop < len(keys) and keys[stop][:2] == (category, top_k):
                stop += 1
            block = work[start:stop]
            dest = order[start:stop]
            if category == _GREEDY_MODIFIED:
                tokens[dest] = np.argmax(block, axis=1)
            else:
                group = [rows[i] for i in dest]
                params = [r.params for r in group]
                # Exactly one draw per row per step keeps a seeded stream independent of the
                # path taken and of the batch.
                if uniforms is None:
                    u = np.array([r.generator.random() for r in group], dtype=np.float64)
                else:
                    u = uniforms[dest]
                noise = race_keys(u) if self.coupled else None
                temps = np.array([q.temperature for q in params], dtype=np.float32)
                block /= temps[:, None]
                min_p = np.array([q.min_p for q in params], dtype=np.float64)
                if category == _DENSE:
                    tokens[dest] = (sample_dense(block, min_p, u) if noise is None
                                    else sample_dense_race(block, min_p, noise))
                elif category == _TOP_K:
                    top_p = np.array([q.top_p for q in params], dtype=np.float64)
                    tokens[dest] = sample_top_k(block, top_k, top_p, min_p, u, noise)
                else:
                    top_p = np.array([q.top_p for q in params], dtype=np.float64)
                    tokens[dest] = sample_top_p(block, top_p, min_p, u, noise)
            start = stop

    @staticmethod
    def _apply_penalties(work: np.ndarray, rows: Sequence[SamplingRow]) -> None:
        apply_penalties(work, [r.params for r in rows], [r.prompt_token_ids for r in rows],
                        [r.output_token_ids for r in rows])

    def _logprobs(
        self, x: np.ndarray, rows: Sequence[SamplingRow], tokens: list[int]
    ) -> tuple[list[float | None], list[list[tuple[int, float]] | None]]:
        n = len(rows)
        logprobs: list[float | None] = [None] * n
        top: list[list[tuple[int, float]] | None] = [None] * n
        wanted = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        if not wanted:
            return logprobs, top
        raw = np.asarray(x[wanted], dtype=np.float32)  # from the RAW logits, before penalties
        values, tops = logprobs_of(raw, [tokens[i] for i in wanted],
                                   [rows[i].params.logprobs or 0 for i in wanted])
        for j, i in enumerate(wanted):
            logprobs[i], top[i] = values[j], tops[j]
        return logprobs, top
