"""Engine options: one frozen dataclass, the single source of every option a served engine takes.

:class:`EngineOptions` holds the scheduler's limits and policy, the KV pool sizes and the runner.
Everything else is generated from its fields:

* the ``kvflow serve`` flags (:func:`add_engine_option_args`), help text included;
* the Triton model parameters that ``kvflow serve`` writes into ``config.pbtxt`` and the backend
  reads back (:func:`options_to_parameters`, :func:`options_from_parameters`);
* the validation of ``LLM(engine_dir, **overrides)`` (:meth:`EngineOptions.with_overrides`).

A new option is one field here, with its help text. Choice lists come from the registries they
name (the schedulers, the runners, the preemption modes), so they cannot drift.
"""

from __future__ import annotations

import argparse
import json
import os
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import MISSING, Field, dataclass, field, fields, replace
from typing import Any

from kvflow import envs
from kvflow.orchestrator.options_check import (  # noqa: F401  (parse_tenant_weights: re-export)
    MAX_SPECULATIVE_TOKENS,
    check_options,
    parse_tenant_weights,
)
from kvflow.runtime.base import KV_CACHE_DTYPES, QUANTIZED_MATMUL_MODES, RUNNERS

PREEMPTION_MODES = ("auto", "recompute", "swap")
SPECULATIVE_METHODS = ("ngram", "draft")
# The scheduling policies by name; kvflow.orchestrator.scheduler.registry has a class for each.
POLICIES = ("fcfs", "priority", "cache_aware", "sjf", "fair", "static")


def _option(default: Any = MISSING, help: str = "", *,  # noqa: A002  (argparse's word)
            choices: Callable[[], tuple[str, ...]] | None = None, flag: str | None = None,
            flag_value: Any = None, flag_help: str = "",
            default_factory: Any = MISSING) -> Any:
    """A field with its help text; ``choices`` names its registry; ``flag``/``flag_value``: a
    CLI switch of its own name that sets ``flag_value`` (``flag_help`` says what it does)."""
    metadata = {"help": help, "choices": choices, "flag": flag, "flag_value": flag_value,
                "flag_help": flag_help}
    if default_factory is not MISSING:
        return field(default_factory=default_factory, metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass(frozen=True)
class EngineOptions:
    """Every option of a served engine: the scheduler's limits and policy, the KV pool and the
    runner. Each field's help text is in its metadata (``kvflow serve --help`` shows it).

    The limits default to the engine folder's build limits when the options are resolved
    against one (:func:`kvflow.orchestrator.llm.plan_engine`); the defaults here serve engines
    built without a folder (the simulator, tests).
    """

    # --- scheduling ---------------------------------------------------------------------------
    max_num_seqs: int = _option(64, "most requests running (holding KV and scheduled) at once "
                                    "(default: the engine's max batch size)")
    max_num_batched_tokens: int = _option(2048, "token budget of one step, prefill and decode "
                                                "tokens together (default: the engine's limit)")
    max_step_ms: float | None = _option(None, "target step time, ms: the step's token budget "
                                        "follows from the measured cost per token (within "
                                        "max_num_batched_tokens), so decode streams keep a "
                                        "gap near it while long prompts are chunked; 0: off "
                                        "(default: 200 on CPU runners, else off)")
    max_model_len: int = _option(2048, "longest sequence, prompt + output (default: the "
                                       "engine's limit)")
    enable_chunked_prefill: bool = _option(True, "split long prompts over several steps, "
                                                 "sharing each with decodes; off, a prompt is "
                                                 "computed in one step or waits")
    long_prefill_token_threshold: int = _option(0, "cap on one request's prefill chunk per "
                                                   "step (0: none), so that one long prompt "
                                                   "cannot take the whole budget")
    max_waiting_requests: int = _option(4096, "bound of the waiting queue; requests beyond it "
                                              "are rejected at once")
    policy: str = _option("fcfs", "fcfs (arrival order), priority (lower value first, with "
                                  "aging and preemption), cache_aware (longest cached prefix "
                                  "first), sjf (shortest job first), fair (per-tenant fair "
                                  "share: a virtual token counter) or static (static "
                                  "batching, the baseline)", choices=lambda: POLICIES)
    priority_aging_s: float = _option(10.0, "priority: a waiting request gains one priority "
                                            "level per this many seconds waited")
    priority_preemption: bool = _option(True, "priority: a waiting request of strictly "
                                              "higher priority preempts a running one when "
                                              "it cannot otherwise be admitted (by KV blocks "
                                              "or by max_num_seqs)")
    max_preemptions_per_request: int = _option(3, "priority preemption: a request already "
                                                  "preempted this many times is not "
                                                  "preempted again for a higher-priority "
                                                  "one (bounds thrash)")
    sjf_max_wait_s: float = _option(10.0, "sjf: a request that waited this long goes ahead "
                                          "of every shorter one (the starvation bound)")
    tenant_weights: str = _option("", "fair: tenant weights, 'name=weight,...'; a tenant "
                                      "with weight 2 gets twice the service of one with 1 "
                                      "(default 1)")
    fair_output_weight: float = _option(2.0, "fair: an output token's weight in a tenant's "
                                             "counter, against 1 for a prompt token")
    request_timeout_s: float | None = _option(None, "deadline of every request, from its "
                                                    "arrival (a request's own timeout_ms "
                                                    "overrides it); past it the request "
                                                    "ends with finish_reason timeout")
    max_queue_delay_ms: float | None = _option(None, "SLO admission: refuse a new request at "
                                                     "once when its predicted wait (the "
                                                     "prompt tokens queued ahead of it over "
                                                     "the measured prefill throughput) "
                                                     "exceeds this")
    max_long_partial_prefills: int | None = _option(None, "most prompts longer than "
                                                          "long_prefill_token_threshold "
                                                          "prefilling at once (none: no cap)")
    kv_watermark: float = _option(0.01, "fraction of KV blocks admission keeps free for "
                                        "running requests to grow into")
    static_batch_size: int | None = _option(None, "static: batch size (default: max_num_seqs)")
    enable_prefix_caching: bool = _option(True, "reuse the KV of cached full blocks across "
                                                "requests")
    preemption_mode: str = _option("auto", "recompute (drop the KV), swap (to the host pool "
                                           "and back) or auto (whichever is estimated cheaper)",
                                   choices=lambda: PREEMPTION_MODES)
    recompute_tokens_per_s: float = _option(2000.0, "auto preemption's cost model: prefill "
                                                    "tokens recomputed per second")
    swap_bytes_per_s: float = _option(4e9, "auto preemption's cost model: bytes swapped per "
                                           "second, each way")
    cache_aware_max_wait_s: float = _option(5.0, "cache_aware: a request that waited this long "
                                                 "is admitted first whatever its cache hit")
    # --- speculative decoding ----------------------------------------------------------------
    speculative: str | None = _option(None, "speculative decoding: ngram (prompt lookup: "
                                            "draft what followed the last tokens' latest "
                                            "earlier match in the prompt and output) or draft "
                                            "(a second, smaller or quantized engine, "
                                            "draft_engine, proposes); lossless either way. "
                                            "Each step's draft length comes from the measured "
                                            "step time against the acceptance, and falls to "
                                            "none at high load (default: off)",
                                      choices=lambda: SPECULATIVE_METHODS)
    num_speculative_tokens: int = _option(4, "speculative decoding: the most draft tokens "
                                             "of one request in one step")
    speculative_draft_length: str = _option("dynamic", "speculative decoding: dynamic (each "
                                                       "step's from the cost model, none at "
                                                       "high load) or fixed (always up to "
                                                       "num_speculative_tokens)",
                                            choices=lambda: ("dynamic", "fixed"))
    draft_engine: str | None = _option(None, "speculative draft: the draft model's engine "
                                             "folder (the target's tokenizer and KV layout)")
    # --- LoRA adapters ------------------------------------------------------------------------
    enable_lora: bool = _option(False, "serve LoRA adapters beside the base model, chosen per "
                                       "request (on as well when lora_modules names some)")
    lora_modules: dict[str, str] = _option(help="LoRA adapters loaded at start, NAME=PATH "
                                                "(a PEFT folder or a GGUF LoRA file); more load "
                                                "at run time", default_factory=dict)
    max_loras: int = _option(4, "LoRA: adapters resident at once (the slot pool); a step holds "
                                "at most this many distinct adapters, others wait their turn")
    max_lora_rank: int = _option(16, "LoRA: the largest adapter rank the slot pool holds "
                                     "(1..256)")
    # --- KV pool and runner -------------------------------------------------------------------
    kv_cache_bytes: int | None = _option(None, "KV pool bytes, capped at what max_num_seqs "
                                               "full sequences use (default: from memory)")
    kv_cache_memory_fraction: float = _option(0.5, "KV pool at most this fraction of the host "
                                                   "memory left after weights, swap and the "
                                                   "host KV tier")
    num_kv_blocks: int | None = _option(None, "KV pool blocks (overrides kv_cache_bytes)")
    swap_space_bytes: int = _option(256 << 20, "host swap pool for preemption by swap (0: none)")
    kv_offload_bytes: int = _option(0, "host KV tier: bytes keeping prefix-cache blocks the "
                                       "pool evicts, restored on a later hit (0: off)")
    kv_disk_dir: str | None = _option(None, "disk KV tier: a folder (mode 0700) of evicted "
                                            "prefix-cache blocks, kept across restarts")
    kv_disk_bytes: int = _option(0, "disk KV tier: its byte budget (LRU; with kv_disk_dir)")
    runner: str | None = _option(None, "runner (default: the engine's backend)",
                                 choices=lambda: RUNNERS)
    cuda_graphs: bool | None = _option(None, "the triton runner's decode CUDA graphs (default: "
                                             "on a CUDA GPU)", flag="--enforce-eager",
                                       flag_value=False, flag_help="the triton runner launches "
                                       "decode steps eagerly, without CUDA graphs")
    # NOTE: the default follows `kvflow bench quality` (docs/benchmarks.md): MatMulQ's int8
    # costs llama.cpp's own KL divergence; ORT's MatMulNBits 4.6x that (then auto is fp32).
    quantized_matmul: str = _option("auto", "quantized engines on the onnxruntime runner: "
                                    "fp32 (weights dequantized at load: exact to HF on the "
                                    "same weights, fp32 speed and memory), int8 (the "
                                    "quantized weights multiplied as they are, activations "
                                    "quantized to int8 per block as llama.cpp does: by "
                                    "kvflow's native MatMulQ, or without it by ORT's "
                                    "MatMulNBits, at 4.6x the quality cost), or auto (int8 "
                                    "at every step size with the native library's GEMM; "
                                    "else int8 up to 16 tokens and fp32 above; fp32 "
                                    "throughout without the native library)",
                                    choices=lambda: QUANTIZED_MATMUL_MODES)
    kv_cache_dtype: str = _option("auto", "the KV cache's element type: fp32, fp16 (half the "
                                  "bytes: twice the blocks in the same kv_cache_bytes and "
                                  "swap_space_bytes; attention still sums in fp32) or auto "
                                  "(onnxruntime: fp16, measured free by kvflow bench "
                                  "quality; torch, the reference: fp32; the GPU runners: the "
                                  "engine's own dtype). int8 is not built yet",
                                  choices=lambda: KV_CACHE_DTYPES)
    trace_steps: str | None = _option(None, "write a step timeline to this file: Chrome "
                                            "Trace Event JSON that Perfetto opens, the last "
                                            "trace_max_steps steps, written at shutdown "
                                            "(kvflow serve: also on SIGUSR1); kvflow trace "
                                            "summarize reads it")
    trace_max_steps: int = _option(10_000, "steps the step timeline keeps (a ring: older "
                                           "steps are dropped)")
    debug_checks: bool = _option(help="check the KV pool's and the scheduler's invariants "
                                      f"after every step (default: ${envs.DEBUG_CHECKS})",
                                 default_factory=envs.debug_checks)

    def __post_init__(self) -> None:
        if isinstance(self.lora_modules, Mapping):  # paths may come as PathLike: kept as text
            object.__setattr__(self, "lora_modules", {
                k: os.fspath(v) if isinstance(v, os.PathLike) else v
                for k, v in self.lora_modules.items()})
        check_options(self)

    @property
    def lora_enabled(self) -> bool:
        """Whether the engine serves adapters: ``enable_lora``, or adapters named at start."""
        return self.enable_lora or bool(self.lora_modules)

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    def with_overrides(self, **overrides: Any) -> EngineOptions:
        """A copy with ``overrides``, each checked against its field's type; unknown keys are
        refused with the list of known ones."""
        known = self.names()
        unknown = sorted(set(overrides) - set(known))
        if unknown:
            raise ValueError(f"unknown engine option(s) {unknown}; known: {sorted(known)}")
        for name, value in overrides.items():
            check_type(name, value)
        return replace(self, **overrides)


def option_fields() -> tuple[Field, ...]:
    """The fields of :class:`EngineOptions`, in declaration order."""
    return fields(EngineOptions)


def option_kind(name: str) -> tuple[type, bool]:
    """(``int``, ``float``, ``bool``, ``str`` or ``dict``; whether None is allowed) of option
    ``name``."""
    hint = typing.get_type_hints(EngineOptions)[name]
    if typing.get_origin(hint) is dict:
        return dict, False
    args = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
    return args[0], type(None) in typing.get_args(hint)


def check_type(name: str, value: Any) -> None:
    """Refuse a value of the wrong type for option ``name``, naming both."""
    kind, optional = option_kind(name)
    if value is None:
        if not optional:
            raise ValueError(f"{name} must be {kind.__name__}, got None")
        return
    ok = (isinstance(value, bool) if kind is bool
          else isinstance(value, int) and not isinstance(value, bool) if kind is int
          else isinstance(value, int | float) and not isinstance(value, bool) if kind is float
          else isinstance(value, Mapping) if kind is dict
          else isinstance(value, kind))
    if not ok:
        raise ValueError(f"{name} must be {kind.__name__}, got {value!r}")


def parse_option(name: str, text: str) -> Any:
    """Option ``name``'s value from text (a CLI argument, a Triton parameter)."""
    if name not in EngineOptions.names():
        raise ValueError(f"unknown engine option {name!r}; known: {sorted(EngineOptions.names())}")
    kind, optional = option_kind(name)
    text = text.strip()
    if optional and text.lower() in ("", "none", "null"):
        return None
    if kind is dict:
        return parse_named_paths(name, [text])
    try:
        if kind is bool:
            lowered = text.lower()
            if lowered not in ("true", "1", "false", "0"):
                raise ValueError
            return lowered in ("true", "1")
        if kind is int:
            return int(text)
        if kind is float:
            return float(text)
    except ValueError:

        raise ValueError(f"{name} must be {kind.__name__}, got {text!r}") from None
    return text


def format_option(value: Any) -> str:
    """The text :func:`parse_option` reads back as ``value``."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, Mapping):
        return json.dumps(dict(value))
    return str(value)


def parse_named_paths(name: str, entries: Sequence[str]) -> dict[str, str]:
    """A ``NAME=PATH`` option (``lora_modules``) from its entries: each ``NAME=PATH`` (several
    in one entry split at whitespace), or one JSON object ``{"NAME": "PATH", ...}`` (the Triton
    parameter's form, and paths with spaces)."""
    if len(entries) == 1 and entries[0].strip().startswith("{"):
        try:
            value = json.loads(entries[0])
        except json.JSONDecodeError as e:
            raise ValueError(f"{name}: not a JSON object of NAME: PATH ({e})") from None
        if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
            raise ValueError(f"{name}: the JSON must map each name to a path, got {value!r}")
        return value
    out: dict[str, str] = {}
    for entry in (e for text in entries for e in text.split()):
        key, sep, path = entry.partition("=")
        if not sep or not key or not path:
            raise ValueError(f"{name}: {entry!r} must be NAME=PATH")
        if key in out:
            raise ValueError(f"{name}: {key!r} is named twice")
        out[key] = path
    return out


def options_to_parameters(overrides: Mapping[str, Any]) -> dict[str, str]:
    """Triton model parameters (``config.pbtxt``) for the given engine options."""
    EngineOptions().with_overrides(**overrides)  # refuse bad options before a server starts
    return {name: format_option(value) for name, value in overrides.items()}


def options_from_parameters(parameters: Mapping[str, str],
                            reserved: tuple[str, ...] = ()) -> dict[str, Any]:
    """Engine options from Triton model parameters; keys in ``reserved`` are the backend's own,
    any other key must be an option."""
    return {name: parse_option(name, text) for name, text in parameters.items()
            if name not in reserved}


# --- the command line: one flag per option -----------------------------------------------
def _flag_type(name: str) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            return parse_option(name, text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return parse


class _NamedPaths(argparse.Action):
    """``--lora-modules NAME=PATH [NAME=PATH ...]`` (or one JSON object) as a dict."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        try:
            setattr(namespace, self.dest, parse_named_paths(self.dest, values))
        except ValueError as e:
            raise argparse.ArgumentError(self, str(e)) from None


def add_engine_option_args(p: argparse.ArgumentParser,
                           only: Sequence[str] | None = None) -> None:
    """One flag per :class:`~kvflow.orchestrator.options.EngineOptions` field (or per field
    named in ``only``), generated from it: ``--max-num-seqs N``; a boolean that is on by
    default, ``enable_X``, becomes ``--no-X``; a field with a switch of its own
    (``--enforce-eager``) gets that. Flags not given are absent from the namespace, so the
    engine folder's limits apply."""
    g = p.add_argument_group("engine options (any kvflow.LLM option)" if only is None
                             else "engine options (as kvflow.LLM takes them)")
    for f in option_fields():
        if only is not None and f.name not in only:
            continue
        meta, kind = f.metadata, option_kind(f.name)[0]
        common = {"dest": f.name, "default": argparse.SUPPRESS, "help": meta["help"]}
        if meta["flag"]:
            g.add_argument(meta["flag"], action="store_const", const=meta["flag_value"],
                           **{**common, "help": meta["flag_help"]})
        elif kind is bool and f.default is True:
            g.add_argument("--no-" + f.name.removeprefix("enable_").replace("_", "-"),
                           action="store_false", **{**common, "help": "turn off: " + meta["help"]})
        elif kind is bool:
            g.add_argument("--" + f.name.replace("_", "-"), action="store_true", **common)
        elif kind is dict:
            g.add_argument("--" + f.name.replace("_", "-"), nargs="+", action=_NamedPaths,
                           metavar="NAME=PATH", **common)
        else:
            choices = meta["choices"]() if meta["choices"] else None
            g.add_argument("--" + f.name.replace("_", "-"), type=_flag_type(f.name),
                           choices=choices, metavar="{" + ",".join(choices) + "}" if choices
                           else kind.__name__.upper(), **common)


def engine_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The engine options given on the command line."""
    given = vars(args)
    return {name: given[name] for name in EngineOptions.names() if name in given}
