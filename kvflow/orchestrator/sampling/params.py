"""Per-request sampling parameters, in vLLM's vocabulary, validated when they are built.

The same names are what clients of Triton's vLLM backend put in the JSON ``sampling_parameters``
input, so :meth:`SamplingParams.from_dict` parses that object directly.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

from kvflow.orchestrator.sampling.structured_output import FIELD_NAMES, StructuredOutput

# vLLM's request fields for structured outputs; from_dict turns them into ``structured``.
GUIDED_FIELDS = tuple(FIELD_NAMES.values())

# Below this temperature the softmax is numerically a one-hot, so sampling is greedy (as vLLM).
GREEDY_TEMPERATURE = 1e-5
MAX_SEED = 2**63 - 1
MAX_LOGPROBS = 20
MAX_TIMEOUT_MS = 7 * 24 * 3600 * 1000  # a week
MAX_N = 256  # completions per request; the scheduler also caps n at max_num_seqs
MAX_ABS_PRESENCE_FREQUENCY_PENALTY = 2.0
# The sampler works in float32 and int32: larger values would overflow or wrap there.
MAX_FLOAT32 = 3.4028234663852886e38
MAX_INT32 = 2**31 - 1


def short_repr(value: object, limit: int = 80) -> str:
    """``repr(value)``, cut to ``limit`` characters: errors name a bad value, never echo it
    whole."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def list_unknown(keys: list[str], most: int = 8) -> str:
    """Unknown keys for an error message: the first ``most``, each cut short, then a count."""
    shown = ", ".join(short_repr(k, 40) for k in keys[:most])
    return shown + (f" and {len(keys) - most} more" if len(keys) > most else "")


def check_text(text: str, field: str) -> str:
    """``text`` if it is valid Unicode; ValueError naming ``field`` if it holds a lone
    surrogate (JSON's ``"\\udc00"`` decodes to one), which no tokenizer or encoder accepts."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{field} holds a lone surrogate (U+{ord(text[e.start]):04X}) at "
                         f"character {e.start}; text must be valid Unicode") from None
    return text


class SamplingParamsTypeError(TypeError, ValueError):
    """A sampling parameter has the wrong type.

    It is both a ``TypeError`` (what it is) and a ``ValueError`` so that a server can turn every
    bad request into a client error with one ``except ValueError``.
    """


def _type_name(value: object) -> str:
    return type(value).__name__


def _as_int(name: str, value: object, *, optional: bool = False) -> int | None:
    if value is None and optional:
        return None
    # bool is an int subclass, but `max_tokens=True` is certainly a client bug.
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        expected = "an int or None" if optional else "an int"
        raise SamplingParamsTypeError(
            f"{name} must be {expected}, got {short_repr(value)} ({_type_name(value)})"
        )
    return int(value)


def _as_float(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise SamplingParamsTypeError(
            f"{name} must be a number, got {short_repr(value)} ({_type_name(value)})"
        )
    result = float(value)
    if math.isnan(result):
        raise ValueError(f"{name} must be a number, got nan")
    return result


def _as_bool(name: str, value: object) -> bool:
    # numpy.bool_ is not a bool subclass; accept it, reject 0/1 and strings.
    if not isinstance(value, bool) and type(value).__name__ != "bool_":
        raise SamplingParamsTypeError(
            f"{name} must be a bool, got {short_repr(value)} ({_type_name(value)})"
        )
    return bool(value)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the next tokens of one request (vLLM's ``SamplingParams`` vocabulary).

    Attributes:
        n: Completions per prompt (parallel sampling: the prompt is computed once and its KV
            blocks shared); in [1, 256] and at most the engine's ``max_num_seqs``. Sequence
            ``j`` of a seeded request draws from ``seed + j``.
        max_tokens: Most tokens to generate (>= 1), or None for "until the context is full".
        min_tokens: Tokens to generate before EOS or ``stop_token_ids`` may be sampled.
        temperature: Softmax temperature (>= 0); below 1e-5 sampling is greedy.
        top_k: Keep the k most likely tokens; 0 or -1 disables it.
        top_p: Keep the smallest most-likely set whose probability reaches top_p, in (0, 1].
        min_p: Drop tokens less likely than ``min_p`` times the most likely one, in [0, 1].
        seed: Seed of this request's own random stream, in [0, 2**63 - 1], or None.
        repetition_penalty: HF-style penalty (> 0) over prompt and output tokens: a positive
            logit is divided by it, a negative one multiplied.
        presence_penalty: OpenAI-style, in [-2, 2]: subtracted once from the logit of every
            token already in the output.
        frequency_penalty: OpenAI-style, in [-2, 2]: subtracted from a token's logit once per
            occurrence in the output.
        stop: Strings that end generation (a str or a list is accepted and kept as a tuple).
        stop_token_ids: Token ids that end generation (kept as a tuple).
        ignore_eos: Keep generating after EOS.
        logprobs: Return the log-probability of the sampled token and of the top ``logprobs``
            tokens (0..20), or None for none.
        prompt_logprobs: Return, for each prompt token after the first, its log-probability
            and the top ``prompt_logprobs`` tokens at its position (0..20; 0: the prompt
            token's alone), or None for none (vLLM's). A request that asks recomputes its
            whole prompt: cached blocks hold no logits.
        skip_special_tokens: Leave special tokens out of the detokenized text.
        structured: What the output must match (a JSON schema, a regex, a choice, a
            grammar, any JSON object), or None; :meth:`from_dict` also takes vLLM's
            ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar`` and
            ``guided_json_object`` for it. A constrained sequence ends when its grammar is
            complete (``min_tokens`` does not hold it open), or at ``max_tokens`` with
            ``length``.
        timeout_ms: The request's deadline, in milliseconds from its arrival, in [1, a week],
            or None for the server's ``request_timeout_s``. Past it the request ends with
            ``finish_reason`` ``timeout`` and the output it has, wherever it is (waiting,
            prefilling or decoding).
        speculative: Let the engine speculate for this request, when it is configured to
            (``EngineOptions.speculative``); False turns it off for this request alone.
            Speculation is lossless: it changes the speed, never the output's distribution.
    """

    n: int = 1
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    structured: StructuredOutput | None = None
    timeout_ms: int | None = None
    speculative: bool = True

    def __post_init__(self) -> None:
        # Normalise types first (ints/floats from numpy or JSON, lists into tuples) so the
        # stored values hash and compare predictably, then check ranges.
        self._set("n", _as_int("n", self.n))
        self._set("max_tokens", _as_int("max_tokens", self.max_tokens, optional=True))
        self._set("min_tokens", _as_int("min_tokens", self.min_tokens))
        self._set("temperature", _as_float("temperature", self.temperature))
        self._set("top_k", _as_int("top_k", self.top_k))
        self._set("top_p", _as_float("top_p", self.top_p))
        self._set("min_p", _as_float("min_p", self.min_p))
        self._set("seed", _as_int("seed", self.seed, optional=True))
        self._set("repetition_penalty", _as_float("repetition_penalty", self.repetition_penalty))
        self._set("presence_penalty", _as_float("presence_penalty", self.presence_penalty))
        self._set("frequency_penalty", _as_float("frequency_penalty", self.frequency_penalty))
        self._set("stop", self._normalise_stop(self.stop))
        self._set("stop_token_ids", self._normalise_stop_token_ids(self.stop_token_ids))
        self._set("ignore_eos", _as_bool("ignore_eos", self.ignore_eos))
        self._set("logprobs", _as_int("logprobs", self.logprobs, optional=True))
        self._set("prompt_logprobs", _as_int("prompt_logprobs", self.prompt_logprobs,
                                             optional=True))
        self._set("skip_special_tokens", _as_bool("skip_special_tokens", self.skip_special_tokens))
        self._set("timeout_ms", _as_int("timeout_ms", self.timeout_ms, optional=True))
        self._set("speculative", _as_bool("speculative", self.speculative))
        if isinstance(self.structured, Mapping):
            self._set("structured", StructuredOutput.from_dict(self.structured))
        elif self.structured is not None and not isinstance(self.structured, StructuredOutput):
            raise SamplingParamsTypeError(
                f"structured must be a StructuredOutput, its dict or None, got "
                f"{short_repr(self.structured)} ({_type_name(self.structured)})")
        self._check_ranges()

    def _set(self, name: str, value: object) -> None:
        object.__setattr__(self, name, value)

    @staticmethod
    def _normalise_stop(stop: object) -> tuple[str, ...]:
        if isinstance(stop, str):
            stop = (stop,)
        if not isinstance(stop, (list, tuple)):
            raise SamplingParamsTypeError(
                f"stop must be a str or a list of str, got {short_repr(stop)} "
                f"({_type_name(stop)})"
            )
        for i, s in enumerate(stop):
            if not isinstance(s, str):
                raise SamplingParamsTypeError(
                    f"stop[{i}] must be a str, got {short_repr(s)} ({_type_name(s)})"
                )
            if not s:
                # An empty stop string would match at every position and end every request.
                raise ValueError(f"stop[{i}] must be a non-empty string, got ''")
            check_text(s, f"stop[{i}]")
        return tuple(stop)

    @staticmethod
    def _normalise_stop_token_ids(ids: object) -> tuple[int, ...]:
        if not isinstance(ids, (list, tuple)):
            raise SamplingParamsTypeError(
                f"stop_token_ids must be a list of int, got {short_repr(ids)} "
                f"({_type_name(ids)})"
            )
        result = []
        for i, token_id in enumerate(ids):
            value = _as_int(f"stop_token_ids[{i}]", token_id)
            assert value is not None
            if value < 0:
                raise ValueError(f"stop_token_ids[{i}] must be >= 0, got {value}")
            result.append(value)
        return tuple(result)

    def _check_ranges(self) -> None:
        if not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be in [1, {MAX_N}], got {self.n}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1 or None, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}"
            )
        if self.max_tokens is not None and self.max_tokens > MAX_INT32:
            raise ValueError(f"max_tokens must be <= {MAX_INT32}, got {self.max_tokens}")
        if self.min_tokens > MAX_INT32:
            raise ValueError(f"min_tokens must be <= {MAX_INT32}, got {self.min_tokens}")
        if not 0.0 <= self.temperature <= MAX_FLOAT32:
            raise ValueError(f"temperature must be in [0, {MAX_FLOAT32:.4g}] (float32), "
                             f"got {self.temperature}")
        if self.top_k != -1 and not 0 <= self.top_k <= MAX_INT32:
            raise ValueError(
                f"top_k must be -1 or 0 (disabled) or in [1, {MAX_INT32}], got {self.top_k}"
            )
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None and not 0 <= self.seed <= MAX_SEED:
            raise ValueError(f"seed must be in [0, 2**63 - 1], got {self.seed}")
        if not 0.0 < self.repetition_penalty <= MAX_FLOAT32:
            raise ValueError(
                f"repetition_penalty must be in (0, {MAX_FLOAT32:.4g}] (float32), got "
                f"{self.repetition_penalty}"
            )
        limit = MAX_ABS_PRESENCE_FREQUENCY_PENALTY
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -limit <= value <= limit:
                raise ValueError(f"{name} must be in [-{limit:g}, {limit:g}], got {value}")
        if self.timeout_ms is not None and not 1 <= self.timeout_ms <= MAX_TIMEOUT_MS:
            raise ValueError(f"timeout_ms must be in [1, {MAX_TIMEOUT_MS}] (a week) or None, "
                             f"got {self.timeout_ms}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}] or None, got {value}")

    @property
    def is_greedy(self) -> bool:
        """Whether the next token is the argmax (temperature below 1e-5)."""
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def has_penalties(self) -> bool:
        """Whether any of the repetition, presence or frequency penalties changes logits."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        """The accepted parameter names, in declaration order."""
        return tuple(f.name for f in fields(cls))

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SamplingParams:
        """Build from a parsed JSON object such as Triton's ``sampling_parameters`` input.

        Keys are the field names, or vLLM's ``guided_*`` fields for ``structured``; absent keys
        keep their defaults. Values must already have the right JSON type (``"0.5"`` is not a
        number): coercing strings would hide client bugs.

        Raises:
            ValueError: on unknown keys (the message lists them and the known ones) or on a bad
                value (a :class:`SamplingParamsTypeError` for a wrong type).
        """
        if not isinstance(d, Mapping):
            raise SamplingParamsTypeError(
                f"sampling parameters must be a JSON object (mapping), got {_type_name(d)}"
            )
        known = (*cls.field_names(), *GUIDED_FIELDS)
        unknown = sorted((k for k in d if k not in known), key=str)
        if unknown:
            raise ValueError(
                f"unknown sampling parameter(s): {list_unknown(unknown)}; "
                f"known parameters: {', '.join(known)}"
            )
        guided = {k: d[k] for k in GUIDED_FIELDS if k in d}
        if guided:
            if "structured" in d:
                raise ValueError(f"give structured or {', '.join(guided)}, not both")
            d = {k: v for k, v in d.items() if k not in guided}
            d["structured"] = StructuredOutput.from_guided(**guided)
        return cls(**d)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict that :meth:`from_dict` turns back into an equal object."""
        d = asdict(self)
        d["stop"] = list(self.stop)
        d["stop_token_ids"] = list(self.stop_token_ids)
        d["structured"] = self.structured.to_dict() if self.structured is not None else None
        return d
