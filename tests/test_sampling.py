"""Specification of SamplingParams (validation, JSON parsing) and of the Sampler's semantics."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvflow.orchestrator.sampling.params import SamplingParams, SamplingParamsTypeError
from kvflow.orchestrator.sampling.sampler import (
    Sampler,
    SamplerOutput,
    SamplingRow,
    make_generator,
)

EOS = 0


def row(
    params: SamplingParams,
    *,
    prompt: list[int] | None = None,
    output: list[int] | None = None,
    seed: int | None = None,
) -> SamplingRow:
    """A SamplingRow whose generator is seeded from ``seed`` or, failing that, params.seed."""
    return SamplingRow(
        params=params,
        prompt_token_ids=prompt if prompt is not None else [],
        output_token_ids=output if output is not None else [],
        generator=make_generator(seed if seed is not None else params.seed),
    )


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def softmax(x: np.ndarray) -> np.ndarray:
    return np.exp(log_softmax(x))


def draw_many(
    sampler: Sampler, logits_row: np.ndarray, params: SamplingParams, draws: int, seed: int = 0
) -> np.ndarray:
    """Sample ``draws`` tokens from one logits row: 200 rows per step, each its own stream."""
    per_step = 200
    rows = [row(params, seed=seed * 100_000 + i) for i in range(per_step)]
    logits = np.tile(np.asarray(logits_row, dtype=np.float32), (per_step, 1))
    out = [sampler.sample(logits, rows).token_ids for _ in range(-(-draws // per_step))]
    return np.asarray(out).reshape(-1)[:draws]


def chi_square(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


# Chi-square critical value for 4 degrees of freedom at p = 0.001; the draws are seeded, so a
# pass is deterministic, and a real bias (say 2% on one token over 20k draws) fails by far.
CHI2_DF4_P001 = 18.47


# --------------------------------------------------------------------------------------------
# SamplingParams
# --------------------------------------------------------------------------------------------


class TestSamplingParamsValidation:
    def test_defaults_are_vllm_defaults(self) -> None:
        p = SamplingParams()
        assert (p.n, p.max_tokens, p.min_tokens, p.temperature) == (1, 16, 0, 1.0)
        assert (p.top_k, p.top_p, p.min_p, p.seed) == (0, 1.0, 0.0, None)
        assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.0, 0.0, 0.0)
        assert p.stop == () and p.stop_token_ids == ()
        assert p.ignore_eos is False and p.logprobs is None and p.skip_special_tokens is True
        assert not p.is_greedy and not p.has_penalties

    @pytest.mark.parametrize(
        ("field", "value", "fragments"),
        [
            ("n", 257, ["n must be in [1, 256]", "got 257"]),
            ("n", 0, ["n must be in [1, 256]", "got 0"]),
            ("max_tokens", 0, ["max_tokens must be >= 1", "got 0"]),
            ("max_tokens", -5, ["max_tokens must be >= 1", "got -5"]),
            ("min_tokens", -1, ["min_tokens must be >= 0", "got -1"]),
            ("temperature", -0.5, ["temperature must be in [0, 3.403e+38] (float32)", "got -0.5"]),
            ("temperature", math.inf, ["temperature must be in [0, 3.403e+38]", "got inf"]),
            ("temperature", 1e39, ["temperature must be in [0, 3.403e+38]", "got 1e+39"]),
            ("temperature", math.nan, ["temperature must be a number", "got nan"]),
            ("top_k", -2, ["top_k must be -1 or 0 (disabled) or in [1, 2147483647]", "got -2"]),
            ("top_k", 2**32 + 1, ["in [1, 2147483647]", "got 4294967297"]),
            ("top_p", 1.5, ["top_p must be in (0, 1], got 1.5"]),
            ("top_p", 0.0, ["top_p must be in (0, 1]", "got 0.0"]),
            ("top_p", -0.1, ["top_p must be in (0, 1]", "got -0.1"]),
            ("min_p", -0.1, ["min_p must be in [0, 1]", "got -0.1"]),
            ("min_p", 1.01, ["min_p must be in [0, 1]", "got 1.01"]),
            ("seed", -1, ["seed must be in [0, 2**63 - 1]", "got -1"]),
            ("seed", 2**63, ["seed must be in [0, 2**63 - 1]", f"got {2**63}"]),
            ("repetition_penalty", 0.0, ["must be in (0, 3.403e+38]", "got 0.0"]),
            ("repetition_penalty", -1.0, ["repetition_penalty must be", "got -1.0"]),
            ("max_tokens", 2**31, ["max_tokens must be <= 2147483647", "got 2147483648"]),
            ("presence_penalty", 2.5, ["presence_penalty must be in [-2, 2]", "got 2.5"]),
            ("presence_penalty", -2.01, ["presence_penalty must be in [-2, 2]", "got -2.01"]),
            ("frequency_penalty", 3.0, ["frequency_penalty must be in [-2, 2]", "got 3.0"]),
            ("stop", [""], ["stop[0] must be a non-empty string"]),
            ("stop", ["ok", ""], ["stop[1] must be a non-empty string"]),
            ("stop_token_ids", [3, -1], ["stop_token_ids[1] must be >= 0", "got -1"]),
            ("logprobs", -1, ["logprobs must be in [0, 20]", "got -1"]),
            ("logprobs", 21, ["logprobs must be in [0, 20]", "got 21"]),
        ],
    )
    def test_out_of_range_values_name_field_value_and_limit(
        self, field: str, value: object, fragments: list[str]
    ) -> None:
        with pytest.raises(ValueError) as info:
            SamplingParams(**{field: value})
        for fragment in fragments:
            assert fragment in str(info.value)

    @pytest.mark.parametrize(
        ("field", "value"),
        [
            ("n", 1.0),
            ("max_tokens", True),
            ("max_tokens", 16.0),
            ("max_tokens", "16"),
            ("min_tokens", 1.5),
            ("temperature", "0.5"),
            ("temperature", True),
            ("temperature", None),
            ("top_k", 5.0),
            ("top_k", "5"),
            ("top_p", "0.9"),
            ("min_p", [0.1]),
            ("seed", 1.0),
            ("seed", "42"),
            ("repetition_penalty", "1.1"),
            ("presence_penalty", None),
            ("frequency_penalty", False),
            ("stop", 5),
            ("stop", [1, 2]),
            ("stop", None),
            ("stop_token_ids", 3),
            ("stop_token_ids", [1.5]),
            ("stop_token_ids", [True]),
            ("stop_token_ids", "12"),
            ("ignore_eos", 1),
            ("ignore_eos", "true"),
            ("logprobs", 2.0),
            ("logprobs", True),
            ("skip_special_tokens", 0),
        ],
    )
    def test_wrong_types_name_the_field_and_the_value(self, field: str, value: object) -> None:
        with pytest.raises(SamplingParamsTypeError) as info:
            SamplingParams(**{field: value})
        message = str(info.value)
        assert message.startswith(field), message
        # Lists of stop strings / ids are checked element by element: the bad element is shown.
        shown = value[0] if field.startswith("stop") and isinstance(value, list) else value
        assert f"got {shown!r}" in message, message
        # One `except ValueError` in a server catches type errors too.
        assert isinstance(info.value, ValueError) and isinstance(info.value, TypeError)

    def test_min_tokens_may_not_exceed_max_tokens(self) -> None:
        with pytest.raises(ValueError, match=r"min_tokens must be <= max_tokens \(4\), got 5"):
            SamplingParams(max_tokens=4, min_tokens=5)
        assert SamplingParams(max_tokens=4, min_tokens=4).min_tokens == 4
        assert SamplingParams(max_tokens=None, min_tokens=1000).min_tokens == 1000

    @pytest.mark.parametrize("top_k", [-1, 0, 1, 50])
    def test_top_k_minus_one_and_zero_disable(self, top_k: int) -> None:
        assert SamplingParams(top_k=top_k).top_k == top_k

    @pytest.mark.parametrize(
        ("temperature", "greedy"), [(0.0, True), (1e-6, True), (1e-5, False), (0.7, False)]
    )
    def test_is_greedy_below_1e_5(self, temperature: float, greedy: bool) -> None:
        assert SamplingParams(temperature=temperature).is_greedy is greedy

    def test_boundaries_are_accepted(self) -> None:
        p = SamplingParams(
            temperature=0, top_p=1.0, min_p=1.0, seed=2**63 - 1, presence_penalty=-2,
            frequency_penalty=2, logprobs=20, max_tokens=1,
        )
        assert p.top_p == 1.0 and p.seed == 2**63 - 1
        assert isinstance(p.temperature, float) and isinstance(p.presence_penalty, float)

    def test_stop_is_normalised_to_a_tuple(self) -> None:
        assert SamplingParams(stop="###").stop == ("###",)
        assert SamplingParams(stop=["a", "bc"]).stop == ("a", "bc")
        assert SamplingParams(stop_token_ids=[2, 7]).stop_token_ids == (2, 7)

    def test_numpy_scalars_are_normalised_to_python_types(self) -> None:
        p = SamplingParams(
            max_tokens=np.int64(8), temperature=np.float32(0.5), stop_token_ids=[np.int32(3)]
        )
        assert type(p.max_tokens) is int and type(p.temperature) is float
        assert type(p.stop_token_ids[0]) is int

    def test_is_frozen_and_hashable(self) -> None:
        p = SamplingParams(stop=["x"])
        with pytest.raises(dataclasses.FrozenInstanceError):
            p.temperature = 0.0  # type: ignore[misc]
        assert hash(p) == hash(SamplingParams(stop=("x",)))
        assert p == SamplingParams(stop="x")

    def test_has_penalties(self) -> None:
        assert SamplingParams(repetition_penalty=1.1).has_penalties
        assert SamplingParams(presence_penalty=-0.5).has_penalties
        assert SamplingParams(frequency_penalty=0.1).has_penalties


class TestSamplingParamsFromDict:
    def test_parses_triton_vllm_style_json(self) -> None:
        p = SamplingParams.from_dict(
            {"temperature": 0.7, "top_p": 0.95, "top_k": 40, "max_tokens": 64, "seed": 3,
             "stop": ["\n\n"], "stop_token_ids": [2], "ignore_eos": True, "logprobs": 2}
        )
        assert p == SamplingParams(
            temperature=0.7, top_p=0.95, top_k=40, max_tokens=64, seed=3, stop=("\n\n",),
            stop_token_ids=(2,), ignore_eos=True, logprobs=2,
        )

    def test_empty_dict_gives_defaults(self) -> None:
        assert SamplingParams.from_dict({}) == SamplingParams()

    def test_json_integers_are_accepted_for_floats(self) -> None:
        assert SamplingParams.from_dict({"temperature": 0, "top_p": 1}).is_greedy

    def test_unknown_keys_are_listed_with_the_known_ones(self) -> None:
        with pytest.raises(ValueError) as info:
            SamplingParams.from_dict({"temperature": 0.5, "best_of": 2, "beam_width": 4})
        message = str(info.value)
        assert "'beam_width'" in message and "'best_of'" in message
        for known in SamplingParams.field_names():
            assert known in message.split("known parameters:")[1]

    @pytest.mark.parametrize(
        ("key", "value"),
        [("temperature", "0.1"), ("max_tokens", "64"), ("top_k", 40.0), ("ignore_eos", "true")],
    )
    def test_wrong_json_types_are_rejected_not_coerced(self, key: str, value: object) -> None:
        with pytest.raises(ValueError, match=f"^{key} must be"):
            SamplingParams.from_dict({key: value})

    def test_rejects_non_mapping(self) -> None:
        with pytest.raises(ValueError, match="must be a JSON object"):
            SamplingParams.from_dict([("temperature", 0.5)])  # type: ignore[arg-type]

    def test_to_dict_round_trips(self) -> None:
        p = SamplingParams(temperature=0.3, stop=["a"], stop_token_ids=[5], logprobs=0)
        d = p.to_dict()
        assert d["stop"] == ["a"] and d["stop_token_ids"] == [5]
        assert SamplingParams.from_dict(d) == p


# --------------------------------------------------------------------------------------------
# Sampler
# --------------------------------------------------------------------------------------------


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)


def random_logits(
    rng: np.random.Generator, rows: int, vocab: int, scale: float = 3.0
) -> np.ndarray:
    return (rng.standard_normal((rows, vocab)) * scale).astype(np.float32)


class TestSamplerBasics:
    def test_make_generator_seeded_is_reproducible(self) -> None:
        a, b = make_generator(7), make_generator(7)
        assert a.random() == b.random()
        assert make_generator(None).random() != make_generator(None).random()

    @pytest.mark.parametrize("seed", [-1, 2**63, 1.5, "3"])
    def test_make_generator_rejects_bad_seeds(self, seed: object) -> None:
        with pytest.raises((ValueError, TypeError), match="seed"):
            make_generator(seed)  # type: ignore[arg-type]

    def test_constructor_validates(self) -> None:
        with pytest.raises(ValueError, match="vocab_size must be >= 1, got 0"):
            Sampler(0, [])
        with pytest.raises(ValueError, match=r"eos_token_ids must be in \[0, 10\), got 10"):
            Sampler(10, [10])

    def test_rejects_logits_of_the_wrong_shape(self) -> None:
        sampler = Sampler(10, [EOS])
        with pytest.raises(ValueError, match="num_rows=2"):
            sampler.sample(np.zeros((3, 10), np.float32), [row(SamplingParams())] * 2)
        with pytest.raises(ValueError, match="at least vocab_size=10 columns, got 9"):
            sampler.sample(np.zeros((1, 9), np.float32), [row(SamplingParams())])

    def test_empty_batch(self) -> None:
        out = Sampler(10, [EOS]).sample(np.zeros((0, 10), np.float32), [])
        assert out == SamplerOutput(token_ids=[], logprobs=[], top_logprobs=[])

    def test_does_not_modify_the_logits(self, rng: np.random.Generator) -> None:
        logits = random_logits(rng, 4, 50)
        before = logits.copy()
        params = [
            SamplingParams(temperature=0, repetition_penalty=1.5),
            SamplingParams(top_k=5, frequency_penalty=1.0),
            SamplingParams(top_p=0.5, min_tokens=3),
            SamplingParams(min_p=0.2),
        ]
        Sampler(50, [EOS]).sample(logits, [row(p, prompt=[1, 2], output=[3]) for p in params])
        np.testing.assert_array_equal(logits, before)


class TestGreedy:
    def test_greedy_is_argmax(self, rng: np.random.Generator) -> None:
        logits = random_logits(rng, 16, 300)
        out = Sampler(300, [EOS]).sample(logits, [row(SamplingParams(temperature=0))] * 16)
        assert out.token_ids == np.argmax(logits, axis=1).tolist()

    def test_greedy_ties_go_to_the_lowest_id(self) -> None:
        logits = np.array([[1.0, 3.0, 3.0, 0.0], [2.0, 2.0, 2.0, 2.0]], np.float32)
        out = Sampler(4, [EOS]).sample(logits, [row(SamplingParams(temperature=0))] * 2)
        assert out.token_ids == [1, 0]

    def test_greedy_draws_nothing_from_the_generator(self) -> None:
        r = row(SamplingParams(temperature=0), seed=5)
        Sampler(8, [EOS]).sample(np.zeros((1, 8), np.float32), [r])
        assert r.generator.random() == make_generator(5).random()

    @pytest.mark.parametrize(
        "params",
        [
            SamplingParams(temperature=1e-6),
            SamplingParams(temperature=1.0, top_k=1),
            SamplingParams(temperature=1.0, top_p=1e-6),
            SamplingParams(temperature=0.8, top_k=20, top_p=1e-9),
            SamplingParams(temperature=1.0, min_p=1.0),
        ],
        ids=["temperature->0", "top_k=1", "tiny top_p", "top_k+tiny top_p", "min_p=1"],
    )
    def test_degenerate_sampling_equals_greedy(
        self, rng: np.random.Generator, params: SamplingParams
    ) -> None:
        logits = random_logits(rng, 32, 500)
        out = Sampler(500, [EOS]).sample(logits, [row(params, seed=i) for i in range(32)])
        assert out.token_ids == np.argmax(logits, axis=1).tolist()

    def test_top_k_1_breaks_ties_like_argmax(self) -> None:
        logits = np.array([[0.0, 5.0, 1.0, 5.0, 5.0]], np.float32)
        for seed in range(20):
            out = Sampler(5, [EOS]).sample(logits, [row(SamplingParams(top_k=1), seed=seed)])
            assert out.token_ids == [1]


class TestDistribution:
    LOGITS = np.array([1.0, 0.0, 2.0, -1.0, 0.5], np.float32)

    def test_temperature_1_matches_softmax(self) -> None:
        tokens = draw_many(Sampler(5, [EOS]), self.LOGITS, SamplingParams(seed=None), 20_000)
        counts = np.bincount(tokens, minlength=5)
        assert chi_square(counts, softmax(self.LOGITS)) < CHI2_DF4_P001

    def test_temperature_scales_logits(self) -> None:
        params = SamplingParams(temperature=0.5)
        tokens = draw_many(Sampler(5, [EOS]), self.LOGITS, params, 20_000, seed=1)
        counts = np.bincount(tokens, minlength=5)
        assert chi_square(counts, softmax(self.LOGITS / 0.5)) < CHI2_DF4_P001

    def test_top_k_renormalises_over_the_k_most_likely(self) -> None:
        tokens = draw_many(Sampler(5, [EOS]), self.LOGITS, SamplingParams(top_k=3), 20_000, 2)
        counts = np.bincount(tokens, minlength=5)
        assert set(np.flatnonzero(counts)) == {0, 2, 4}
        kept = [2, 0, 4]
        probs = softmax(self.LOGITS[kept])
        observed = counts[kept]
        expected = probs * observed.sum()
        assert ((observed - expected) ** 2 / expected).sum() < 13.82  # df=2, p=0.001

    def test_top_p_keeps_the_token_that_crosses_the_threshold(self) -> None:
        probs = softmax(self.LOGITS)  # sorted: token 2 (.56), 0 (.21), 4 (.13), ...
        top_p = float(probs[2] + probs[0] / 2)  # token 0 crosses the line: kept; 4 is not
        params = SamplingParams(top_p=top_p)
        tokens = draw_many(Sampler(5, [EOS]), self.LOGITS, params, 20_000, 3)
        counts = np.bincount(tokens, minlength=5)
        assert set(np.flatnonzero(counts)) == {0, 2}
        share = counts[2] / counts.sum()
        assert share == pytest.approx(probs[2] / (probs[2] + probs[0]), abs=0.015)

    def test_top_p_applies_to_the_top_k_renormalised_distribution(self) -> None:
        # Softmax: token 2 .56, 0 .21, 4 .13, 1 .08, 3 .03. After top_k=2 it is renormalised to
        # {2: .73, 0: .27}, so top_p=0.6 is reached by token 2 alone.
        params = SamplingParams(top_k=2, top_p=0.6)
        tokens = draw_many(Sampler(5, [EOS]), self.LOGITS, params, 2_000, 4)
        assert set(tokens.tolist()) == {2}
        # Without top_k, token 2 (.56) alone does not reach 0.6: token 0 is kept too.
        tokens = draw_many(Sampler(5, [EOS]), self.LOGITS, SamplingParams(top_p=0.6), 2_000, 5)
        assert set(tokens.tolist()) == {0, 2}

    def test_min_p_drops_tokens_below_a_fraction_of_the_top_probability(self) -> None:
        logits = np.log(np.array([1.0, 0.6, 0.4, 0.1, 0.55], np.float32))
        params = SamplingParams(min_p=0.5)
        tokens = draw_many(Sampler(5, [EOS]), logits, params, 20_000, 6)
        counts = np.bincount(tokens, minlength=5)
        assert set(np.flatnonzero(counts)) == {0, 1, 4}
        kept = np.array([1.0, 0.6, 0.55])
        observed = counts[[0, 1, 4]]
        expected = kept / kept.sum() * observed.sum()
        assert ((observed - expected) ** 2 / expected).sum() < 13.82  # df=2, p=0.001

    def test_min_p_is_relative_to_the_temperature_scaled_distribution(self) -> None:
        # p_1 / p_0 = e^-1 = 0.37 at temperature 1, e^-2 = 0.14 at temperature 0.5.
        logits = np.array([1.0, 0.0], np.float32)
        hot = draw_many(Sampler(2, [EOS]), logits, SamplingParams(min_p=0.2), 2_000, 7)
        cold = draw_many(
            Sampler(2, [EOS]), logits, SamplingParams(min_p=0.2, temperature=0.5), 2_000, 8
        )
        assert set(hot.tolist()) == {0, 1} and set(cold.tolist()) == {0}

    def test_top_p_with_a_nucleus_larger_than_the_candidate_set(self) -> None:
        # 3000 equal logits: the nucleus of 0.5 is 1500 tokens, more than the 1024 candidates
        # the fast path looks at; ties go to lower ids, so exactly ids 0..1499 are kept.
        logits = np.zeros(3000, np.float32)
        tokens = draw_many(Sampler(3000, [EOS]), logits, SamplingParams(top_p=0.5), 4_000, 9)
        assert tokens.max() < 1500
        assert tokens.max() > 1400 and tokens.min() < 100  # and it is spread over all of them

    def test_top_k_ties_go_to_lower_ids(self) -> None:
        logits = np.zeros(200, np.float32)
        tokens = draw_many(Sampler(200, [EOS]), logits, SamplingParams(top_k=10), 2_000, 10)
        assert set(tokens.tolist()) == set(range(10))

    def test_exactly_one_draw_per_step_per_sampled_row(self, rng: np.random.Generator) -> None:
        params = [SamplingParams(), SamplingParams(top_k=5), SamplingParams(top_p=0.8),
                  SamplingParams(min_p=0.1, frequency_penalty=0.5)]
        rows = [row(p, seed=100 + i) for i, p in enumerate(params)]
        sampler = Sampler(64, [EOS])
        for _ in range(3):
            sampler.sample(random_logits(rng, 4, 64), rows)
        for i, r in enumerate(rows):
            twin = make_generator(100 + i)
            twin.random(size=3)
            assert r.generator.random() == twin.random()


class TestReproducibility:
    PARAMS = [
        SamplingParams(temperature=0.9, seed=11),
        SamplingParams(temperature=0.7, top_k=40, seed=12),
        SamplingParams(temperature=1.2, top_p=0.9, seed=13),
        SamplingParams(temperature=1.0, top_k=30, top_p=0.8, min_p=0.02, seed=14),
        SamplingParams(temperature=0.8, min_p=0.05, seed=15),
        SamplingParams(temperature=1.0, repetition_penalty=1.3, presence_penalty=0.4,
                       frequency_penalty=0.3, seed=16),
        SamplingParams(temperature=1.5, top_p=0.995, seed=17),  # full-row top_p path
    ]
    VOCAB = 3000
    STEPS = 20

    def generate(self, target: SamplingParams, neighbours: list[SamplingParams], position: int,
                 pad: int, noise_seed: int) -> list[int]:
        """Run STEPS steps of `target` in a batch with `neighbours`; return its tokens."""
        sampler = Sampler(self.VOCAB, [EOS])
        step_rng = np.random.default_rng(99)  # the target's logits: the same in every run
        noise = np.random.default_rng(noise_seed)  # the neighbours' logits: differ per run
        params = list(neighbours)
        params.insert(position, target)
        rows = [row(p, prompt=[5, 6, 7], seed=p.seed if p.seed is not None else 1000 + i)
                for i, p in enumerate(params)]
        produced: list[int] = []
        for _ in range(self.STEPS):
            logits = (noise.standard_normal((len(rows), self.VOCAB + pad)) * 4).astype(np.float32)
            logits[position, : self.VOCAB] = step_rng.standard_normal(self.VOCAB) * 4
            out = sampler.sample(logits, rows)
            for r, token in zip(rows, out.token_ids, strict=True):
                r.output_token_ids = [*r.output_token_ids, token]
            produced.append(out.token_ids[position])
        return produced

    @pytest.mark.parametrize("target", range(len(PARAMS)))
    def test_seeded_tokens_do_not_depend_on_the_batch(self, target: int) -> None:
        mine = self.PARAMS[target]
        others = [p for i, p in enumerate(self.PARAMS) if i != target]
        alone = self.generate(mine, [], position=0, pad=0, noise_seed=0)
        crowded = self.generate(mine, others, position=3, pad=64, noise_seed=1)
        copies = self.generate(mine, [mine, mine, SamplingParams(temperature=0)],
                               position=2, pad=0, noise_seed=2)
        shuffled = self.generate(mine, others[::-1] + others, position=len(others) * 2,
                                 pad=7, noise_seed=3)
        assert alone == crowded == copies == shuffled
        assert len(set(alone)) > 1  # it really sampled

    def test_different_seeds_give_different_sequences(self) -> None:
        a = self.generate(SamplingParams(seed=1), [], 0, 0, 0)
        b = self.generate(SamplingParams(seed=2), [], 0, 0, 0)
        assert a != b

    @pytest.mark.parametrize("coupled", [False, True], ids=["cdf", "race"])
    @pytest.mark.parametrize("target", range(len(PARAMS)))
    def test_draw_picks_what_sample_would_with_the_same_number(self, target: int,
                                                               coupled: bool) -> None:
        """Speculative decoding's way to sample: ``draw`` with the number a row's generator
        holds next is ``sample``, on every path; it reads no generator."""
        params = self.PARAMS[target]
        sampler = Sampler(self.VOCAB, [EOS], coupled=coupled)
        rng = np.random.default_rng(5)
        for step in range(10):
            logits = (rng.standard_normal((2, self.VOCAB + 3)) * 4).astype(np.float32)
            rows = [row(params, prompt=[5, 6], output=[7, 8], seed=step),
                    row(SamplingParams(temperature=0), seed=step)]
            u = [make_generator(step).random(), 0.5]
            drawn = sampler.draw(logits, rows, u)
            assert drawn == sampler.sample(logits, rows).token_ids
            assert rows[0].generator.random() == make_generator(step).random(2)[1]

    def test_draw_wants_one_number_per_row(self) -> None:
        with pytest.raises(ValueError, match="uniforms"):
            Sampler(8, [EOS]).draw(np.zeros((2, 8), np.float32),
                                   [row(SamplingParams())] * 2, [0.5])


class TestPenalties:
    LOGITS = np.array([[2.0, -1.0, 0.5, 0.0, 3.0, -2.0]], np.float32)

    def processed(self, params: SamplingParams, prompt: list[int], output: list[int]) -> np.ndarray:
        sampler = Sampler(6, [EOS])
        return sampler.processed_logits(self.LOGITS, [row(params, prompt=prompt, output=output)])[0]

    def test_repetition_penalty_divides_positive_and_multiplies_negative_logits(self) -> None:
        got = self.processed(SamplingParams(repetition_penalty=2.0), prompt=[0, 1], output=[2, 2])
        # Tokens 0, 1 (prompt) and 2 (output, once despite appearing twice) are penalised.
        np.testing.assert_array_equal(got, [1.0, -2.0, 0.25, 0.0, 3.0, -2.0])

    def test_repetition_penalty_below_one_encourages(self) -> None:
        got = self.processed(SamplingParams(repetition_penalty=0.5), prompt=[1], output=[4])
        np.testing.assert_array_equal(got, [2.0, -0.5, 0.5, 0.0, 6.0, -2.0])

    def test_frequency_and_presence_penalties_follow_openai(self) -> None:
        params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
        got = self.processed(params, prompt=[0, 1, 5], output=[2, 2, 3, 2])
        # logit - count * frequency - (count > 0) * presence, over the output only.
        expected = [2.0, -1.0, 0.5 - 3 * 0.25 - 0.5, 0.0 - 0.25 - 0.5, 3.0, -2.0]
        np.testing.assert_allclose(got, expected, rtol=0, atol=1e-6)

    def test_negative_presence_and_frequency_encourage(self) -> None:
        params = SamplingParams(presence_penalty=-1.0, frequency_penalty=-0.5)
        got = self.processed(params, prompt=[], output=[5, 5])
        np.testing.assert_allclose(got[5], -2.0 + 2 * 0.5 + 1.0, atol=1e-6)

    def test_repetition_comes_before_presence_and_frequency(self) -> None:
        params = SamplingParams(repetition_penalty=2.0, presence_penalty=1.0, frequency_penalty=1.0)
        got = self.processed(params, prompt=[4], output=[4])
        np.testing.assert_allclose(got[4], 3.0 / 2.0 - 1.0 - 1.0, atol=1e-6)

    def test_penalties_steer_greedy_sampling(self) -> None:
        params = SamplingParams(temperature=0, frequency_penalty=2.0)
        sampler = Sampler(6, [EOS])
        out = sampler.sample(self.LOGITS, [row(params, output=[4])])
        assert out.token_ids == [0]  # 3.0 - 2.0 = 1.0 < 2.0

    def test_penalties_in_a_batch_touch_only_their_row(self, rng: np.random.Generator) -> None:
        logits = random_logits(rng, 3, 40)
        rows = [row(SamplingParams(), output=[1, 2]),
                row(SamplingParams(repetition_penalty=1.5, frequency_penalty=0.7), output=[1, 2]),
                row(SamplingParams(), output=[1, 2])]
        got = Sampler(40, [EOS]).processed_logits(logits, rows)
        np.testing.assert_array_equal(got[[0, 2]], logits[[0, 2]])
        assert not np.array_equal(got[1], logits[1])

    def test_token_ids_outside_the_vocabulary_are_ignored(self) -> None:
        got = self.processed(SamplingParams(repetition_penalty=2.0, presence_penalty=1.0),
                             prompt=[99], output=[6, 1000])
        np.testing.assert_array_equal(got, self.LOGITS[0])


class TestMinTokens:
    VOCAB = 8
    STOP = 5

    def logits(self) -> np.ndarray:
        # EOS and the stop token are by far the most likely.
        logits = np.zeros((1, self.VOCAB), np.float32)
        logits[0, EOS] = 20.0
        logits[0, self.STOP] = 19.0
        logits[0, 3] = 1.0
        return logits

    def test_eos_and_stop_tokens_are_masked_until_min_tokens(self) -> None:
        params = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[self.STOP])
        sampler = Sampler(self.VOCAB, [EOS])
        for n_out in range(3):
            r = row(params, output=[3] * n_out)
            masked = sampler.processed_logits(self.logits(), [r])[0]
            assert masked[EOS] == -np.inf and masked[self.STOP] == -np.inf
            assert sampler.sample(self.logits(), [r]).token_ids == [3]
        assert sampler.sample(self.logits(), [row(params, output=[3] * 3)]).token_ids == [EOS]

    def test_masked_tokens_are_never_sampled(self) -> None:
        params = SamplingParams(min_tokens=2, stop_token_ids=[self.STOP])
        sampler = Sampler(self.VOCAB, [EOS])
        rows = [row(params, output=[1], seed=i) for i in range(300)]
        out = sampler.sample(np.repeat(self.logits(), 300, axis=0), rows)
        assert EOS not in out.token_ids and self.STOP not in out.token_ids

    def test_ignore_eos_leaves_eos_alone_but_still_masks_stop_tokens(self) -> None:
        params = SamplingParams(
            temperature=0, min_tokens=3, stop_token_ids=[self.STOP], ignore_eos=True
        )
        sampler = Sampler(self.VOCAB, [EOS])
        masked = sampler.processed_logits(self.logits(), [row(params)])[0]
        assert masked[EOS] == 20.0 and masked[self.STOP] == -np.inf
        assert sampler.sample(self.logits(), [row(params)]).token_ids == [EOS]

    def test_all_eos_ids_are_masked(self) -> None:
        sampler = Sampler(self.VOCAB, [EOS, 7])
        masked = sampler.processed_logits(self.logits(), [row(SamplingParams(min_tokens=1))])[0]
        assert masked[EOS] == -np.inf and masked[7] == -np.inf
        assert np.isfinite(masked[[1, 2, 3, 4, 5, 6]]).all()

    def test_a_fully_masked_row_still_returns_a_token(self) -> None:
        sampler = Sampler(2, [0, 1])
        for params in (SamplingParams(min_tokens=1), SamplingParams(min_tokens=1, top_p=0.5),
                       SamplingParams(min_tokens=1, top_k=1), SamplingParams(temperature=0,
                                                                             min_tokens=1)):
            out = sampler.sample(np.zeros((1, 2), np.float32), [row(params, seed=0)])
            assert out.token_ids[0] in (0, 1)


class TestLogprobs:
    def test_sampled_and_top_logprobs_match_log_softmax_of_raw_logits(
        self, rng: np.random.Generator
    ) -> None:
        logits = random_logits(rng, 3, 100)
        params = [SamplingParams(temperature=0, logprobs=5),
                  SamplingParams(top_k=10, logprobs=3, repetition_penalty=1.8),
                  SamplingParams(logprobs=None)]
        out = Sampler(100, [EOS]).sample(
            logits, [row(p, prompt=[1, 2, 3], output=[4], seed=i) for i, p in enumerate(params)]
        )
        for i, n in ((0, 5), (1, 3)):
            expected = log_softmax(logits[i])  # raw: penalties do not change logprobs
            assert out.logprobs[i] == pytest.approx(expected[out.token_ids[i]], abs=1e-5)
            top = out.top_logprobs[i]
            assert top is not None and len(top) == n
            ids = [t for t, _ in top]
            assert ids == np.argsort(-expected, kind="stable")[:n].tolist()
            values = [v for _, v in top]
            assert values == sorted(values, reverse=True)
            np.testing.assert_allclose(values, expected[ids], atol=1e-5)
        assert out.logprobs[2] is None and out.top_logprobs[2] is None

    def test_greedy_sampled_logprob_is_the_top_one(self, rng: np.random.Generator) -> None:
        logits = random_logits(rng, 1, 50)
        out = Sampler(50, [EOS]).sample(logits, [row(SamplingParams(temperature=0, logprobs=1))])
        assert out.top_logprobs[0] == [(out.token_ids[0], pytest.approx(out.logprobs[0]))]

    def test_logprobs_zero_gives_only_the_sampled_token(self, rng: np.random.Generator) -> None:
        logits = random_logits(rng, 1, 50)
        out = Sampler(50, [EOS]).sample(logits, [row(SamplingParams(logprobs=0), seed=1)])
        assert out.top_logprobs == [[]]
        assert out.logprobs[0] == pytest.approx(log_softmax(logits[0])[out.token_ids[0]],
                                                abs=1e-5)

    def test_top_logprobs_ties_are_ordered_by_id(self) -> None:
        logits = np.array([[0.0, 1.0, 1.0, 1.0, 0.5]], np.float32)
        out = Sampler(5, [EOS]).sample(logits, [row(SamplingParams(temperature=0, logprobs=2))])
        top = out.top_logprobs[0]
        assert top is not None and [t for t, _ in top] == [1, 2]

    def test_logprobs_exclude_padding(self) -> None:
        logits = np.array([[0.0, 1.0, 2.0, 50.0, 60.0]], np.float32)  # 2 padded columns
        out = Sampler(3, [EOS]).sample(logits, [row(SamplingParams(temperature=0, logprobs=20))])
        top = out.top_logprobs[0]
        assert top is not None and [t for t, _ in top] == [2, 1, 0]
        np.testing.assert_allclose([v for _, v in top], log_softmax(logits[0, :3])[[2, 1, 0]],
                                   atol=1e-6)


class TestPaddedVocab:
    @pytest.mark.parametrize(
        "params",
        [SamplingParams(temperature=0), SamplingParams(), SamplingParams(top_k=5),
         SamplingParams(top_p=0.9), SamplingParams(min_p=0.1),
         SamplingParams(temperature=0, repetition_penalty=1.2)],
    )
    def test_padding_columns_are_never_sampled(self, params: SamplingParams) -> None:
        vocab, pad = 37, 27
        logits = np.full((50, vocab + pad), 1e4, np.float32)
        logits[:, :vocab] = np.random.default_rng(0).standard_normal((50, vocab))
        out = Sampler(vocab, [EOS]).sample(logits, [row(params, seed=i) for i in range(50)])
        assert max(out.token_ids) < vocab


# --------------------------------------------------------------------------------------------
# Properties
# --------------------------------------------------------------------------------------------


def reference_support(
    logits: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float
) -> np.ndarray:
    """Tokens a correct sampler may return, computed in float64 and generous at boundaries."""
    s = logits.astype(np.float64) / temperature
    tol = 1e-4 * max(1.0, float(np.abs(s).max()))
    vocab = s.size
    in_k = np.ones(vocab, bool)
    if 0 < top_k < vocab:
        kth = np.sort(s)[::-1][top_k - 1]
        in_k = s >= kth - tol  # ties at the k-th value may go either way
    p = np.where(in_k, np.exp(s - s.max()), 0.0)
    p /= p.sum()
    # top_p: a token is kept while the mass strictly ahead of it is below top_p.
    ahead = np.array([p[(s > s[i] + tol) & in_k].sum() for i in range(vocab)])
    in_p = ahead < top_p + 1e-6
    in_min_p = p >= min_p * p.max() * (1 - 1e-4) - 1e-12
    return np.flatnonzero(in_k & in_p & in_min_p)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    logits=st.lists(
        st.floats(-20, 20, allow_nan=False, width=32), min_size=2, max_size=40
    ),
    temperature=st.floats(0.05, 3.0),
    top_k=st.sampled_from([0, -1, 1, 2, 3, 5, 10, 50]),
    top_p=st.floats(0.01, 1.0),
    min_p=st.one_of(st.just(0.0), st.floats(0.0, 1.0)),
    seed=st.integers(0, 2**63 - 1),
    pad=st.integers(0, 5),
)
def test_sampled_token_is_always_inside_the_top_k_top_p_min_p_support(
    logits: list[float], temperature: float, top_k: int, top_p: float, min_p: float, seed: int,
    pad: int,
) -> None:
    vocab = len(logits)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                            seed=seed)
    padded = np.full((1, vocab + pad), 1e6, np.float32)
    padded[0, :vocab] = logits
    sampler = Sampler(vocab, [EOS])
    first = sampler.sample(padded, [row(params)]).token_ids[0]
    assert first in reference_support(np.asarray(logits), temperature, top_k, top_p, min_p)
    assert sampler.sample(padded, [row(params)]).token_ids[0] == first  # same seed, same token


@settings(max_examples=200, deadline=None)
@given(
    logits=st.lists(st.integers(-3, 3), min_size=1, max_size=30),  # small ints: many ties
    temperature=st.sampled_from([0.0, 1e-6]),
)
def test_greedy_is_the_first_argmax(logits: list[int], temperature: float) -> None:
    x = np.asarray([logits], np.float32)
    out = Sampler(len(logits), [EOS]).sample(x, [row(SamplingParams(temperature=temperature))])
    assert out.token_ids == [int(np.argmax(x[0]))]


# --------------------------------------------------------------------------------------------
# The coupled draw (the race)
# --------------------------------------------------------------------------------------------

HEAVY = [5, 100, 2000, 2500, 2999]  # on both sides of the 1024 most likely


def race_reference(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The sampler's distribution by hand: softmax at the temperature, top-k, top-p (of the
    top-k renormalised), min-p (ties in the order: lower id first)."""
    p = softmax(logits.astype(np.float64) / params.temperature)
    order = sorted(range(p.size), key=lambda t: (-p[t], t))
    keep = order[:params.top_k] if params.top_k > 0 else order
    mass, ahead, nucleus = sum(p[t] for t in keep), 0.0, []
    for t in keep:
        if ahead < params.top_p:
            nucleus.append(t)
        ahead += p[t] / mass
    out = np.zeros_like(p)
    kept = [t for t in nucleus if p[t] >= params.min_p * p[nucleus[0]]]
    out[kept] = p[kept]
    return out / out.sum()


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0),  # the dense race: the rest of the row holds 2/3
    SamplingParams(temperature=0.7, min_p=0.02),
    SamplingParams(temperature=1.0, top_k=50),
    SamplingParams(temperature=1.0, top_p=0.5),  # a nucleus past the candidate set
], ids=["dense", "min_p", "top_k", "top_p"])
def test_the_race_draws_the_samplers_distribution(params: SamplingParams) -> None:
    """Sampler(coupled=True) draws the same distribution as the inverse CDF: 8000 seeded
    draws over 3000 tokens, in 7 cells (5 heavy tokens, the other candidates, the rest),
    against the distribution built by hand."""
    from scipy.stats import chisquare

    vocab, n = 3000, 8000
    logits = np.zeros(vocab, np.float32)
    logits[HEAVY] = 4.0
    rows = [row(params, seed=i) for i in range(n)]
    tokens = Sampler(vocab, [EOS], coupled=True).draw(
        np.tile(logits, (n, 1)), rows, np.random.default_rng(1).random(n))

    def cells(x: np.ndarray) -> np.ndarray:
        rest = x.copy()
        rest[HEAVY] = 0
        return np.array([*x[HEAVY], rest[:1024].sum(), rest[1024:].sum()])

    counts = cells(np.bincount(tokens, minlength=vocab).astype(np.float64))
    expected = cells(race_reference(logits, params)) * n
    assert counts[expected == 0].sum() == 0
    assert chisquare(counts[expected > 0], expected[expected > 0]).pvalue > 1e-4


def test_the_race_couples_close_distributions() -> None:
    """Two close distributions drawn with the same numbers agree about as often as their
    overlap (1 - TV) allows, by the race; the inverse CDF's token order makes that rarer."""
    rng = np.random.default_rng(0)
    vocab, n = 2000, 400
    agree: dict[bool, list[float]] = {False: [], True: []}
    overlap = []
    for _ in range(5):
        p = (rng.standard_normal(vocab) * 3).astype(np.float32)
        q = (p + rng.standard_normal(vocab) * 0.1).astype(np.float32)
        u = rng.random(n)
        rows = [row(SamplingParams())] * n
        for coupled in (False, True):
            sampler = Sampler(vocab, [EOS], coupled=coupled)
            a = sampler.draw(np.tile(p, (n, 1)), rows, u)
            b = sampler.draw(np.tile(q, (n, 1)), rows, u)
            agree[coupled].append(float(np.mean(np.array(a) == np.array(b))))
        overlap.append(float(np.minimum(softmax(p), softmax(q)).sum()))
    assert np.mean(agree[True]) > np.mean(overlap) - 0.03
    assert np.mean(agree[False]) < np.mean(agree[True]) - 0.1
