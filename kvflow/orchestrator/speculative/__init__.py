"""Speculative decoding, in vLLM v1's shape. Pure Python and NumPy.

After each step a :class:`~kvflow.orchestrator.speculative.proposers.Proposer` drafts tokens
for the running requests (``Request.spec_token_ids``); the
:class:`~kvflow.orchestrator.speculative.draft_length.DraftLengthPolicy` decides how many each
keeps, from the measured step time and acceptance; the scheduler schedules them with the
decode; the runner scores every position in one step; and
:mod:`~kvflow.orchestrator.speculative.verification` accepts them left to right: each emitted
token is the one the sampler picks without speculation, greedy or sampled, so the output is
the non-speculative output token for token, whatever the drafts.
:class:`~kvflow.orchestrator.speculative.decoder.SpeculativeDecoder` is the one object the
engine holds. The design: ``docs/design.md``, "Speculative decoding".
"""
