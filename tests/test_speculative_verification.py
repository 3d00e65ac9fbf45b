"""Speculative verification, pure NumPy (no model): lossless under a grammar, checked by a
chi-square test against a distribution built by hand (never by the code under test), and
reproducible: a seeded request emits the same tokens whatever its draft count, and the same
as without speculation.

Four tokens: A, B, X, and EOS. The grammar ``[AB]+`` (a real llguidance grammar over a
four-token tokenizer) refuses X everywhere and EOS first; the target and the drafter are
Markov models that like X, so drafts are often refused and cut where the grammar refuses them
(the decoder's rule)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
from scipy.stats import chisquare

from kvflow.orchestrator.output_processor import RequestState
from kvflow.orchestrator.request import Request, RequestStatus
from kvflow.orchestrator.sampling.params import SamplingParams
from kvflow.orchestrator.sampling.sampler import Sampler, SamplingRow, make_generator
from kvflow.orchestrator.sampling.structured import GrammarCompiler
from kvflow.orchestrator.sampling.structured_output import StructuredOutput
from kvflow.orchestrator.speculative.decoder import SpeculativeDecoder
from kvflow.orchestrator.speculative.proposers import Proposer
from kvflow.orchestrator.speculative.verification import accept_greedy, peek_uniforms, verify

A, B, X, EOS = range(4)
VOCAB = 4
START = A  # the prompt's last token
# Allowed tokens by hand, for "[AB]+": the first token A or B; then A, B or the end.
FIRST, LATER = np.array([1, 1, 0, 0], bool), np.array([1, 1, 0, 1], bool)
PARAMS = [SamplingParams(temperature=1.0),
          SamplingParams(temperature=0.8, top_k=2),
          SamplingParams(temperature=1.0, top_p=0.7, presence_penalty=0.7),
          SamplingParams(temperature=0.9, min_p=0.3)]


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"A": A, "B": B, "X": X, "</s>": EOS}, unk_token="</s>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return GrammarCompiler(tok.to_str(), VOCAB, [EOS])


class Markov:
    """Next-token logits that depend on the last token alone."""

    def __init__(self, table: Sequence[Sequence[float]]) -> None:
        self.table = np.asarray(table, np.float32)

    def logits(self, tokens: Sequence[int]) -> np.ndarray:
        return np.stack([self.table[t] for t in tokens])


TARGET = Markov([[0.0, 0.4, 1.5, 0.2], [0.3, 0.0, 1.0, 0.5],
                 [0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
DRAFTER = Markov([[0.5, -1.0, 1.2, 0.0], [0.0, 0.6, 0.8, 0.1],
                  [0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])


def reference(logits: np.ndarray, params: SamplingParams, allowed: np.ndarray,
              output: Sequence[int]) -> np.ndarray:
    """The distribution a sampler must draw from, the simplest way: presence penalty,
    mask, softmax at the temperature, then top-k, top-p (of the top-k renormalised), min-p."""
    x = logits.astype(np.float64).copy()
    for t in set(output):
        x[t] -= params.presence_penalty
    x[~allowed] = -np.inf
    p = np.exp((x - x.max()) / params.temperature)
    p /= p.sum()
    order = sorted(range(VOCAB), key=lambda t: (-p[t], t))
    keep = [t for t in order if p[t] > 0]
    if 0 < params.top_k < VOCAB:
        keep = keep[:params.top_k]
    mass = sum(p[t] for t in keep)
    nucleus, ahead = [], 0.0
    for t in keep:  # a token stays while the mass strictly ahead of it is below top_p
        if ahead < params.top_p:
            nucleus.append(t)
        ahead += p[t] / mass
    keep = [t for t in nucleus if p[t] >= params.min_p * p[nucleus[0]]]
    out = np.zeros(VOCAB)
    out[keep] = p[keep]
    return out / out.sum()


# How drafts are drawn: with the uniforms the request's stream holds for its next tokens
# (a draft model's way), by the inverse CDF or by the race (the target's sampler then races
# too); or by the inverse CDF from a stream of the proposer's own.
DRAWS = ["cdf", "race", "independent"]


class MarkovProposer(Proposer):
    """Drafts from a Markov model through the target's sampler rules, drawn as ``draw``
    says (:data:`DRAWS`)."""

    name = "markov"

    def __init__(self, model: Markov, draw: str, seed: int = 11) -> None:
        self.model, self.draw = model, draw
        self.coupled = draw == "race"
        self.sampler = Sampler(VOCAB, [EOS], coupled=self.coupled)
        self.rng = np.random.default_rng(seed)

    def propose(self, requests, max_tokens, token_budget=None):
        out = []
        for r, k in zip(requests, max_tokens, strict=True):
            assert r.engine_state is not None
            us = (self.rng.random(k) if self.draw == "independent"
                  else peek_uniforms(r.engine_state.generator, k))
            drafts: list[int] = []
            for j in range(k):
                row = SamplingRow(r.sampling_params, r.prompt_token_ids,
                                  [*r.output_token_ids, *drafts], self.rng)
                last = (r.token_ids + drafts)[-1]
                drafts += self.sampler.draw(self.model.logits([last]), [row], [us[j]])
            out.append(drafts)
        return out


def new_request(compiler, params: SamplingParams, seed: int) -> Request:
    """A running request whose next step decodes, with its random stream and (``compiler``
    given) the grammar ``[AB]+``."""
    r = Request("r", [EOS, START], params, 0.0, eos_token_ids=(EOS,))
    r.status = RequestStatus.RUNNING
    grammar = (None if compiler is None
               else compiler.compile(StructuredOutput("regex", "[AB]+")))
    r.engine_state = RequestState(None, make_generator(seed), False, grammar)
    return r


def generate(compiler, params: SamplingParams, seed: int, n: int,
             decoder: SpeculativeDecoder | None, coupled: bool = False) -> list[int]:
    """A seeded request's first ``n`` tokens (fewer if EOS ends it), step by step as the
    engine runs them: drafts (the decoder's, cut by the grammar) then verification; or,
    without a decoder, the sampler alone under the grammar's mask. ``coupled``: the sampler
    draws by the race."""
    r = new_request(compiler, params, seed)
    state = r.engine_state
    assert state is not None
    sampler = Sampler(VOCAB, [EOS], coupled=coupled)
    while r.num_output_tokens < n:
        r.num_computed_tokens = r.num_tokens - 1
        if decoder is None:
            mask = None
            if state.grammar is not None:
                mask = np.zeros((1, 1), np.int32)
                state.grammar.fill_bitmask(mask, 0)
            row = SamplingRow(params, r.prompt_token_ids, r.output_token_ids,
                              state.generator, None if mask is None else mask[0])
            tokens = sampler.sample(TARGET.logits([r.token_ids[-1]]), [row]).token_ids
        else:
            decoder.propose([r])
            drafts, r.spec_token_ids = r.spec_token_ids, []
            [tokens], _ = decoder.verify(
                sampler, [r], [drafts], [TARGET.logits([r.token_ids[-1], *drafts])], None,
                lambda q: SamplingRow(q.sampling_params, q.prompt_token_ids,
                                      q.output_token_ids, state.generator))
        for t in tokens:
            assert state.grammar is None or state.grammar.accept(t)
            r.append_output_token(t)
            if t == EOS:
                return r.output_token_ids[:n]
    return r.output_token_ids[:n]


def test_accept_greedy():
    assert accept_greedy([5, 6, 7, 8], [5, 6, 7]) == [5, 6, 7, 8]  # all, then the bonus
    assert accept_greedy([5, 9, 7, 8], [5, 6, 7]) == [5, 9]  # the correction ends it
    assert accept_greedy([4, 6, 7, 8], [5, 6, 7]) == [4]


@pytest.mark.parametrize("draw", DRAWS)
def test_the_issues_example_a_refused_draft_does_not_bias_the_output(compiler, draw):
    """Target (masked) {A: .5, B: .5}; the draft {A: .5, X: .5}, X refused and cut. A must
    come out half the time (the cut position drawn afresh, as the old rule did with the
    draft's rejection lost, gave A 75%)."""
    target = Markov([[0.0, 0.0, 5.0, 0.0]] * 4)  # X would win, were it allowed
    drafter = Markov([[0.0, -30.0, 0.0, -30.0]] * 4)
    decoder = SpeculativeDecoder(MarkovProposer(drafter, draw), 1, dynamic=False)
    sampler = Sampler(VOCAB, [EOS], coupled=draw == "race")
    counts = np.zeros(VOCAB)
    gen = make_generator(3)
    n = 10_000
    for _ in range(n):
        r = new_request(compiler, SamplingParams(temperature=1.0), 0)
        assert r.engine_state is not None
        r.engine_state.generator = gen
        r.num_computed_tokens = r.num_tokens - 1
        decoder.propose([r])
        drafts = r.spec_token_ids
        assert drafts in ([], [A])
        [tokens], _ = decoder.verify(
            sampler, [r], [drafts], [target.logits([START, *drafts])], None,
            lambda q: SamplingRow(q.sampling_params, q.prompt_token_ids, q.output_token_ids,
                                  gen))
        counts[tokens[0]] += 1
    assert counts[X] == counts[EOS] == 0
    assert chisquare(counts[:2], [n / 2, n / 2]).pvalue > 1e-4


@pytest.mark.parametrize("draw", DRAWS)
@pytest.mark.parametrize("params", PARAMS, ids=["plain", "top_k", "top_p+presence", "min_p"])
def test_two_tokens_under_a_grammar_have_the_targets_distribution(compiler, params, draw):
    """Two drafts a step, cut by the grammar: the first two emitted tokens' joint
    distribution (16 cells) equals the masked, filtered target's, built by hand."""
    exact = np.zeros((VOCAB, VOCAB))
    p1 = reference(TARGET.table[START], params, FIRST, [])
    for a in range(VOCAB):
        if p1[a] > 0:
            exact[a] = p1[a] * reference(TARGET.table[a], params, LATER, [a])
    decoder = SpeculativeDecoder(MarkovProposer(DRAFTER, draw), 2, dynamic=False)
    counts = np.zeros((VOCAB, VOCAB))
    n = 4000
    for seed in range(n):
        first, second = generate(compiler, params, seed, 2, decoder, draw == "race")
        counts[first, second] += 1
    keep = exact.ravel() > 0
    assert counts.ravel()[~keep].sum() == 0
    assert chisquare(counts.ravel()[keep], exact.ravel()[keep] * n).pvalue > 1e-4
    drafted = decoder.policy.accepted - 2.0  # the prior's pseudo-drafts
    assert drafted > 0, "no draft was ever accepted: the test tested nothing"


@pytest.mark.parametrize("params", PARAMS, ids=["plain", "top_k", "top_p+presence", "min_p"])
def test_a_seeded_request_repeats_whatever_its_draft_count(compiler, params):
    """The same seed gives the same tokens with 1, 2 or 5 drafts a step, however drawn, and
    without speculation at all (by the inverse CDF, and by the race)."""
    for seed in range(20):
        for coupled in (False, True):
            plain = generate(compiler, params, seed, 12, None, coupled)
            for k in (1, 2, 5):
                for draw in (["race"] if coupled else ["cdf", "independent"]):
                    decoder = SpeculativeDecoder(MarkovProposer(DRAFTER, draw, seed=k), k,
                                                 dynamic=False)
                    assert generate(compiler, params, seed, 12, decoder, coupled) == plain


@pytest.mark.parametrize("draw", ["cdf", "race"])
def test_a_draft_from_the_targets_own_distribution_is_always_accepted(draw):
    """Drafted with the request's own uniforms from the target's distribution (no grammar),
    every draft is the target's token: the draft and verification use the same numbers."""
    decoder = SpeculativeDecoder(MarkovProposer(TARGET, draw), 3, dynamic=False)
    for seed in range(10):
        generate(None, PARAMS[2], seed, 9, decoder, draw == "race")
    assert decoder.policy.rejections == 2.0  # the prior's pseudo-rejections alone
    assert decoder.policy.accepted > 2.0 + 10


def test_a_racing_proposer_needs_a_racing_sampler():
    decoder = SpeculativeDecoder(MarkovProposer(TARGET, "race"), 3, dynamic=False)
    with pytest.raises(ValueError, match="Sampler.coupled"):
        generate(None, PARAMS[0], 0, 3, decoder, coupled=False)


def test_verification_draws_one_number_per_emitted_token():
    """Whatever the acceptance, the stream advances by the tokens emitted, as the
    non-speculative steps would: the next token's number is the same either way."""
    sampler = Sampler(VOCAB, [EOS])
    params = SamplingParams(temperature=1.0)
    logits = TARGET.logits([START, A, B])
    for seed in range(50):
        gen = make_generator(seed)
        out = verify(sampler, logits, SamplingRow(params, [START], [], gen), [A, B])
        ref = make_generator(seed)
        ref.random(len(out))
        assert gen.random() == ref.random()
