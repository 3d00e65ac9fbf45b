"""Structured outputs: constrained decoding with llguidance (JSON schema, regex, choice, grammar).

How a grammar reaches the sampler:

1. A request's ``guided_*`` field becomes a :class:`StructuredOutput` (``kind`` + canonical
   ``spec``), checked when the request is built, like every other sampling parameter.
2. The engine's one :class:`GrammarCompiler` compiles it, once per distinct ``(kind, spec)``:
   a bounded LRU keeps a pristine ``LLMatcher`` per schema, and every request gets a
   :class:`Grammar` wrapping a deep copy of it (tens of microseconds). An invalid spec raises
   ``ValueError`` prefixed with the request field, so the front door can answer 400.
3. The orchestrator keeps one :class:`Grammar` per sequence (``fork()`` for the siblings of a
   parallel-sampling request). Each step, for the constrained rows only, :func:`fill_bitmasks`
   writes one bit per token (1 = allowed) into an int32 bitmask, and :func:`apply_bitmask` sets
   the disallowed logits of those rows to ``-inf`` before sampling; unconstrained rows are not
   touched.
4. The sampled token is fed back with :meth:`Grammar.accept`. When the grammar is complete and
   nothing can follow, :attr:`Grammar.is_stopped` turns true and the engine finishes the sequence
   there. The mask allows EOS exactly when the grammar is accepting: EOS cannot cut an output
   short, only max_tokens can.

Pure Python over llguidance and NumPy: no torch, so that the simulator can run it too.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import llguidance
import numpy as np
from llguidance import LLExecutor, LLMatcher, LLParserLimits, LLTokenizer
from llguidance.numpy import fill_next_token_bitmask, fill_next_token_bitmask_par

from kvflow.orchestrator.sampling.structured_output import (  # noqa: F401  (re-exported)
    FIELD_NAMES,
    MAX_ERROR_CHARS,
    MAX_SPEC_BYTES,
    STRUCTURED_KINDS,
    StructuredOutput,
    describe_value,
)

if TYPE_CHECKING:  # only in llguidance's stub
    from llguidance._lib import JsonCompileOptions

# NOTE: JSON is generated compactly, with the separators of Python's json.dumps, and no other
# whitespace: with flexible whitespace a sampled model can emit spaces and newlines between
# tokens forever without ever breaking the grammar. ``overrides`` (not ``defaults``) so that a
# schema's own "x-guidance" cannot turn it back on.
JSON_OPTIONS: JsonCompileOptions = {
    "whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

# Bounds on the work one grammar may cost. The initial lexer fuel (llguidance's default is 1M,
# about 2 s on this machine for a regex like `x{1000}{1000}`) bounds the eager precomputation
# at compile time: past it, llguidance builds the lexer lazily, step by step, where the step
# fuel bounds each mask. Terse errors: a verbose one dumps the parser's state and the grammar.
PARSER_LIMITS = LLParserLimits(initial_lexer_fuel=200_000, verbose_errors=False)


def _short(message: str) -> str:
    message = message.strip()
    return message if len(message) <= MAX_ERROR_CHARS else message[:MAX_ERROR_CHARS - 3] + "..."


class Grammar:
    """One sequence's grammar state: which tokens may come next, advanced token by token.

    Made by :meth:`GrammarCompiler.compile`. Not thread-safe: one thread steps a sequence.
    """

    def __init__(self, matcher: LLMatcher, vocab_size: int) -> None:
        self._matcher = matcher
        self.vocab_size = vocab_size

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` (bit ``t % 32`` of word
        ``t // 32`` is token ``t``). A stopped or failed grammar allows only EOS."""
        _check_bitmask(bitmask, row + 1, self.vocab_size)
        fill_next_token_bitmask(self._matcher, bitmask, row)

    def accept(self, token_id: int) -> bool:
        """Consume the sampled token; False if the grammar rejects it (it is then in error)."""
        return self._matcher.consume_token(int(token_id))

    @property
    def is_stopped(self) -> bool:
        """No token but EOS can follow (the output is complete, or the grammar failed: check
        :attr:`is_error`). The engine finishes the sequence here."""
        return self._matcher.is_stopped()

    @property
    def is_accepting(self) -> bool:
        """The output so far is complete: EOS is allowed (more tokens may be too)."""
        return self._matcher.is_accepting()

    @property
    def is_error(self) -> bool:
        """A rejected token or a resource limit put the grammar in error, for good."""
        return self._matcher.is_error()

    @property
    def error(self) -> str | None:
        """The grammar's error message, or None."""
        return _short(self._matcher.get_error()) if self._matcher.is_error() else None

    def num_valid(self, token_ids: Sequence[int]) -> int:
        """How many of ``token_ids``, in order, the grammar would accept from here (a draft
        is cut there); changes nothing."""
        if not token_ids:
            return 0
        return int(self._matcher.validate_tokens([int(t) for t in token_ids]))

    def masks_along(self, token_ids: Sequence[int]) -> np.ndarray:
        """The bitmasks of the ``len(token_ids) + 1`` positions from here, each after the
        tokens before it (which the grammar must accept: :meth:`num_valid`); the grammar is
        left where it was."""
        masks = allocate_bitmask(len(token_ids) + 1, self.vocab_size)
        consumed = 0
        try:
            for j in range(len(token_ids) + 1):
                fill_next_token_bitmask(self._matcher, masks, j)
                if j < len(token_ids):
                    if not self._matcher.consume_token(int(token_ids[j])):
                        raise ValueError(f"the grammar refuses draft token {token_ids[j]}")
                    consumed += 1
        finally:
            if consumed:
                self._matcher.rollback(consumed)
        return masks

    def fork(self) -> Grammar:
        """An independent copy in the same state (for the siblings of a parallel sample)."""
        return Grammar(self._matcher.deep_copy(), self.vocab_size)


class GrammarCompiler:
    """Compiles StructuredOutputs into Grammars for one engine's tokenizer and vocabulary.

    ``tokenizer_json``: the ``tokenizers`` JSON (``Tokenizer.to_str()``, an engine folder's
    ``tokenizer.json``); ``vocab_size``: the model's logits width (may exceed the tokenizer's
    vocabulary: the extra ids are never allowed); ``eos_token_ids``: the model's EOS ids.

    The llguidance tokenizer is built on the first compile (about a second) and kept. Compiled
    grammars are kept in an LRU of ``cache_size`` entries keyed by ``(kind, spec)``; failed
    compiles are not cached (each retry recompiles and raises again). Thread-safe: requests may
    be compiled on a front-end thread while another steps the engine.
    """

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: Sequence[int],
                 cache_size: int = 64) -> None:
        if not isinstance(tokenizer_json, str) or not tokenizer_json:
            raise ValueError("tokenizer_json must be the tokenizer's JSON text")
        if not isinstance(vocab_size, int) or isinstance(vocab_size, bool) or vocab_size < 1:
            raise ValueError(f"vocab_size must be an int >= 1, got {describe_value(vocab_size)}")
        eos = [int(t) for t in eos_token_ids]
        if not eos or any(not 0 <= t < vocab_size for t in eos):
            raise ValueError(f"eos_token_ids must be a non-empty list of ids below vocab_size "
                             f"({vocab_size}), got {eos}")
        if not isinstance(cache_size, int) or cache_size < 0:
            raise ValueError(f"cache_size must be an int >= 0, got {describe_value(cache_size)}")
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos)
        self.cache_size = cache_size
        self.cache_hits = 0
        self.cache_misses = 0
        self._tokenizer_json = tokenizer_json
        self._tokenizer: LLTokenizer | None = None
        self._cache: OrderedDict[tuple[str, str], LLMatcher] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def cache_len(self) -> int:
        """How many compiled grammars the cache holds now."""
        return len(self._cache)

    def compile(self, so: StructuredOutput) -> Grammar:
        """A fresh Grammar for ``so``; ValueError ``"<field>: <compiler message>"`` if the spec
        does not compile (bad regex, unsupported or unsatisfiable schema, bad grammar)."""
        key = (so.kind, so.spec)
        with self._lock:
            pristine = self._cache.get(key)
            if pristine is not None:
                self._cache.move_to_end(key)
                self.cache_hits += 1
                return Grammar(pristine.deep_copy(), self.vocab_size)
            self.cache_misses += 1
            tokenizer = self._llg_tokenizer()
        # NOTE: outside the lock: building the matcher drops the GIL and may take a while for a
        # big schema; two threads missing on the same key both compile, and one copy is kept.
        pristine = _build_matcher(so, tokenizer)
        with self._lock:
            if self.cache_size:
                self._cache[key] = pristine
                self._cache.move_to_end(key)
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
            return Grammar(pristine.deep_copy(), self.vocab_size)

    def _llg_tokenizer(self) -> LLTokenizer:
        if self._tokenizer is None:
            from tokenizers import Tokenizer

            # As llguidance.hf does: padding or truncation settings would change the vocabulary.
            tok = Tokenizer.from_str(self._tokenizer_json)
            tok.no_padding()
            tok.no_truncation()
            try:
                self._tokenizer = LLTokenizer(tok.to_str(), n_vocab=self.vocab_size,
                                              eos_token=list(self.eos_token_ids))
            except ValueError as e:
                # The engine's configuration, not the request: never a client error.
                raise RuntimeError(f"GrammarCompiler: llguidance refused the tokenizer with "
                                   f"vocab_size {self.vocab_size}: {e}") from e
        return self._tokenizer


def schema_error(schema: dict[str, Any]) -> str:
    """Why llguidance cannot compile JSON schema ``schema`` as :func:`_build_matcher` would
    ("" when it can), checked without a tokenizer: for a front door to name the field."""
    try:
        grammar = LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides=JSON_OPTIONS)
    except (ValueError, TypeError) as e:
        return _short(str(e))
    except RecursionError:
        return "it is nested too deeply"
    return _short(LLMatcher.validate_grammar(grammar, limits=PARSER_LIMITS))


def _build_matcher(so: StructuredOutput, tokenizer: LLTokenizer) -> LLMatcher:
    field = so.field_name()
    try:
        if so.kind == "json":
            grammar = LLMatcher.grammar_from_json_schema(so.spec, overrides=JSON_OPTIONS)
        elif so.kind == "json_object":
            grammar = LLMatcher.grammar_from_json_schema('{"type":"object"}',
                                                         overrides=JSON_OPTIONS)
        elif so.kind == "regex":
            grammar = LLMatcher.grammar_from_regex(so.spec)
        elif so.kind == "choice":
            grammar = llguidance.grammar_from("choice", so.spec)
        else:  # Lark, or GBNF that llguidance converts to Lark
            grammar = llguidance.grammar_from("grammar", so.spec)
    except ValueError as e:
        raise ValueError(f"{field}: {_short(str(e))}") from None
    matcher = LLMatcher(tokenizer, grammar, log_level=0, limits=PARSER_LIMITS)
    if matcher.is_error():
        raise ValueError(f"{field}: {_short(matcher.get_error())}")
    # Computing the first mask builds the lexer states every copy shares: pay it here, at
    # compile time, not in the first decode step.
    matcher.compute_bitmask()
    if matcher.is_error():
        error = _short(matcher.get_error().replace("<non-verbose/>", ""))
        if error.isidentifier():  # llguidance's bare stop reason: say what it means
            error = f"no output can satisfy it (llguidance: {error})"
        raise ValueError(f"{field}: {error}")
    return matcher


def allocate_bitmask(num_rows: int, vocab_size: int) -> np.ndarray:
    """An int32 bitmask of ``num_rows`` rows of ``ceil(vocab_size / 32)`` words, all allowed."""
    return np.full((num_rows, (vocab_size + 31) // 32), -1, dtype=np.int32)


def _check_bitmask(bitmask: np.ndarray, num_rows: int, vocab_size: int) -> None:
    words = (vocab_size + 31) // 32
    if (not isinstance(bitmask, np.ndarray) or bitmask.dtype != np.int32 or bitmask.ndim != 2
            or not bitmask.flags["C_CONTIGUOUS"]):
        raise ValueError("bitmask must be a C-contiguous 2-D int32 array (allocate_bitmask)")
    if bitmask.shape[0] < num_rows or bitmask.shape[1] != words:
        raise ValueError(f"bitmask has shape {bitmask.shape}; it needs at least {num_rows} "
                         f"rows of {words} words (vocab_size {vocab_size})")


_executor: LLExecutor | None = None
_executor_lock = threading.Lock()


def _get_executor() -> LLExecutor:
    global _executor
    with _executor_lock:
        if _executor is None:
            _executor = LLExecutor()
        return _executor


def fill_bitmasks(grammars: Sequence[Grammar], bitmask: np.ndarray) -> None:
    """Fill ``bitmask[i]`` for ``grammars[i]``, in parallel on llguidance's thread pool (one per
    process) when there is more than one."""
    if not grammars:
        return
    vocab_size = grammars[0].vocab_size
    if any(g.vocab_size != vocab_size for g in grammars):
        raise ValueError("fill_bitmasks: the grammars come from compilers of different vocab_size")
    _check_bitmask(bitmask, len(grammars), vocab_size)
    if len(grammars) == 1:
        fill_next_token_bitmask(grammars[0]._matcher, bitmask, 0)
        return
    fill_next_token_bitmask_par(_get_executor(),
                                [(g._matcher, i) for i, g in enumerate(grammars)], bitmask)


# Byte of a bitmask -> its 8 tokens as int32 words, for a branch-free AND / OR on the bits of
# float32 logits: _KEEP is -1 (all ones) for an allowed token and 0 otherwise; _FILL is 0 for
# an allowed token and the bits of -inf (0xFF800000) otherwise.
_NEG_INF_BITS = np.int32(np.array(-np.inf, np.float32).view(np.int32).item())
_KEEP = np.negative((np.arange(256)[:, None] >> np.arange(8)) & 1).astype(np.int32)
_FILL = np.bitwise_and(np.invert(_KEEP), _NEG_INF_BITS).astype(np.int32)


def apply_bitmask(logits: np.ndarray, bitmask: np.ndarray,
                  rows: Sequence[int] | np.ndarray | None = None) -> None:
    """Set every disallowed token's logit to ``-inf``, in place.

    ``logits``: a float 2-D array; row ``i`` of ``bitmask`` applies to ``logits[i]``, or, with
    ``rows``, to ``logits[rows[i]]`` (the constrained rows of a batch; the others are left
    alone). Columns past ``32 * bitmask.shape[1]`` are disallowed; a narrower ``logits``
    ignores the extra bits.
    """
    if not isinstance(logits, np.ndarray) or logits.ndim != 2 or logits.dtype.kind != "f":
        raise ValueError("logits must be a 2-D float array")
    if not isinstance(bitmask, np.ndarray) or bitmask.dtype != np.int32 or bitmask.ndim != 2:
        raise ValueError("bitmask must be a 2-D int32 array (allocate_bitmask)")
    if rows is None:
        if logits.shape[0] != bitmask.shape[0]:
            raise ValueError(f"logits has {logits.shape[0]} rows; the bitmask has "
                             f"{bitmask.shape[0]}")
    else:
        index = np.asarray(rows, dtype=np.intp)
        if index.ndim != 1 or len(index) != bitmask.shape[0]:
            raise ValueError(f"rows has {index.size} entries; the bitmask has "
                             f"{bitmask.shape[0]} rows")
        if len(index) and not (-logits.shape[0] <= index.min() <= index.max()
                               < logits.shape[0]):
            raise ValueError(f"rows must index the {logits.shape[0]} rows of logits")
    num_rows = bitmask.shape[0]
    if num_rows == 0:
        return
    vocab = logits.shape[1]
    covered = min(vocab, 32 * bitmask.shape[1])
    # Bit t % 32 of word t // 32 is token t: little-endian bytes, each byte's bits from the
    # lowest, which is the order of the tables' 8 columns.
    mask_bytes = np.ascontiguousarray(bitmask).astype("<i4", copy=False).view(np.uint8)
    # NOTE: branch-free, so that the cost does not depend on the mask: a masked copy
    # (np.copyto(where=...)) mispredicts on irregular masks (inside a string with a maxLength,
    # say) and takes twice as long.
    keep = _KEEP.take(mask_bytes, axis=0).reshape(num_rows, -1)[:, :covered]
    if logits.dtype != np.float32:
        target = logits if rows is None else logits[index]
        np.copyto(target[:, :covered], -np.inf, where=keep == 0)
        target[:, covered:] = -np.inf
        if rows is not None:
            logits[index] = target
        return
    fill = _FILL.take(mask_bytes, axis=0).reshape(num_rows, -1)[:, :covered]
    bits = logits.view(np.int32)
    if rows is None:
        np.bitwise_and(bits[:, :covered], keep, out=bits[:, :covered])
        np.bitwise_or(bits[:, :covered], fill, out=bits[:, :covered])
        logits[:, covered:] = -np.inf
        return
    # Row by row on views: cheaper than gathering the rows and scattering them back.
    for i, row in enumerate(index.tolist()):
        np.bitwise_and(bits[row, :covered], keep[i], out=bits[row, :covered])
        np.bitwise_or(bits[row, :covered], fill[i], out=bits[row, :covered])
        logits[row, covered:] = -np.inf
