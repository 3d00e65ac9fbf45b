"""Verifying draft tokens. NumPy only.

Every row, greedy or sampled, emits exactly the tokens the sampler would have emitted without
speculation: at each position the target's token is the sampler's own pick
(:meth:`~kvflow.orchestrator.sampling.sampler.Sampler.draw`: penalties over the output so far,
drafts included; ``min_tokens``; the grammar's mask; temperature, top-k, top-p, min-p; the
inverse CDF) with the uniform the request's random stream holds for that position; drafts are
accepted while they equal it, and the first that differs is replaced by it (or, all accepted,
the next position's token follows). The stream gives one number per emitted token, as the
sampler's steps take it, so:

* **lossless**: every emitted token is a draw from the target's (masked, filtered)
  distribution, whatever the drafts were, how they were drawn, and where a grammar cut them;
* **reproducible**: a seeded request's tokens do not depend on its draft count (the draft
  length policy, the step's load, ``num_speculative_tokens``, other requests, or speculation
  being off): token ``i`` is always drawn with the stream's ``i``-th number.

This is a coupling of the draft and the target rather than Leviathan et al.'s rejection
sampling, whose emitted token depends on the draft and so on whether a position had one. An
n-gram's draft ``d`` is accepted with probability ``p(d)``, as there. A draft model draws its
drafts with the very uniforms verification will use
(:class:`~kvflow.orchestrator.speculative.draft_model.DraftModelProposer`): by the race
(``Sampler.coupled``, :mod:`~kvflow.orchestrator.sampling.race`) a draft distribution ``q``
close to ``p`` is accepted about as often as under rejection sampling (``1 - TV(p, q)``; at
least ``(1 - TV) / (1 + TV)``); by the inverse CDF, less often on flat distributions.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvflow.orchestrator.sampling.sampler import Sampler, SamplingRow


def accept_greedy(targets: Sequence[int], drafts: Sequence[int]) -> list[int]:
    """The tokens a row emits: the target's token at each position (``targets``, one more
    than ``drafts``) until the first that differs from its draft, that one included; all
    drafts and the token after them when none differs."""
    out: list[int] = []
    for draft, target in zip(drafts, targets, strict=False):
        out.append(int(target))
        if target != draft:
            return out
    out.append(int(targets[len(drafts)]))
    return out


def peek_uniforms(generator: np.random.Generator, n: int) -> np.ndarray:
    """The next ``n`` numbers ``generator.random()`` will return, leaving it where it was:
    the uniforms of a request's next ``n`` output tokens."""
    state = generator.bit_generator.state
    out = generator.random(n)  # the same numbers as n single draws
    generator.bit_generator.state = state
    return out


def verify(sampler: Sampler, logits: np.ndarray, row: SamplingRow, drafts: Sequence[int],
           masks: np.ndarray | Sequence[np.ndarray | None] | None = None) -> list[int]:
    """The tokens one sequence emits after scoring its ``k`` drafts.

    ``logits``: the raw logits of the ``k + 1`` positions (the sequence's last token, then
    each draft); ``row``: the sequence's sampling row before the drafts (its generator
    advances by one number per emitted token, as ``len(result)`` sampler steps would);
    ``masks``: per position, its grammar's bitmask (None: unconstrained). Returns the
    accepted drafts and then the target's token (1 to ``k + 1`` tokens).
    """
    k = len(drafts)
    output = list(row.output_token_ids)
    rows = [SamplingRow(row.params, row.prompt_token_ids, [*output, *drafts[:j]], row.generator,
                        None if masks is None else masks[j]) for j in range(k + 1)]
    if row.params.is_greedy:
        return accept_greedy(sampler.draw(logits, rows, np.zeros(k + 1)), drafts)
    gen = row.generator
    uniforms = peek_uniforms(gen, k + 1)
    out = accept_greedy(sampler.draw(logits, rows, uniforms), drafts)
    gen.random(len(out))  # consumed: one number per emitted token
    return out
