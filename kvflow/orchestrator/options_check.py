"""The checks of :class:`~kvflow.orchestrator.options.EngineOptions`: each refusal names the
field, the value and the limit. Kept apart from the dataclass so that its file stays the list of
options."""

from __future__ import annotations

from dataclasses import fields
from typing import TYPE_CHECKING

from kvflow.lora.adapter import check_lora_name
from kvflow.runtime.base import check_kv_cache_dtype

if TYPE_CHECKING:
    from kvflow.orchestrator.options import EngineOptions

MAX_SPECULATIVE_TOKENS = 32
MAX_LORA_RANK = 256  # the slot pool's rank bound (max_lora_rank), as vLLM's
# The runners that cannot apply adapters (their engine graph has no LoRA op).
NO_LORA_RUNNERS = ("tensorrt",)


def check_options(o: EngineOptions) -> None:
    """Refuse a bad value of any option of ``o`` (ValueError naming it)."""
    check_kv_cache_dtype(o.kv_cache_dtype)  # before the generic choices: int8's message
    for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len",
                 "max_waiting_requests", "trace_max_steps"):
        value = getattr(o, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    for f in fields(o):
        choices = f.metadata["choices"]
        value = getattr(o, f.name)
        if choices is not None and value is not None and value not in choices():
            raise ValueError(f"{f.name} must be one of {choices()}, got {value!r}")
    for name in ("long_prefill_token_threshold", "max_preemptions_per_request",
                 "swap_space_bytes"):
        if getattr(o, name) < 0:
            raise ValueError(f"{name} must be >= 0, got {getattr(o, name)}")
    if not 0 < o.kv_cache_memory_fraction <= 1:
        raise ValueError(f"kv_cache_memory_fraction must be in (0, 1], got "
                         f"{o.kv_cache_memory_fraction}")
    if not o.priority_aging_s > 0:
        raise ValueError(f"priority_aging_s must be > 0, got {o.priority_aging_s}")
    if not 0 <= o.kv_watermark < 1:
        raise ValueError(f"kv_watermark must be in [0, 1), got {o.kv_watermark}")
    for name in ("recompute_tokens_per_s", "swap_bytes_per_s", "cache_aware_max_wait_s",
                 "sjf_max_wait_s", "fair_output_weight"):
        if not getattr(o, name) > 0:
            raise ValueError(f"{name} must be > 0, got {getattr(o, name)}")
    if o.max_step_ms is not None and not 0 <= o.max_step_ms < float("inf"):
        raise ValueError(f"max_step_ms must be finite, >= 0 (0: off), got {o.max_step_ms}")
    if o.max_step_ms and not o.enable_chunked_prefill:
        raise ValueError(f"max_step_ms={o.max_step_ms:g} needs enable_chunked_prefill "
                         "(a step bounded in time splits long prompts); set it to 0")
    for name in ("request_timeout_s", "max_queue_delay_ms"):
        value = getattr(o, name)
        if value is not None and not value > 0:
            raise ValueError(f"{name} must be > 0 (or none), got {value}")
    if o.max_long_partial_prefills is not None:
        if o.max_long_partial_prefills < 1:
            raise ValueError(f"max_long_partial_prefills must be >= 1 (or none), got "
                             f"{o.max_long_partial_prefills}")
        if not o.long_prefill_token_threshold:
            raise ValueError("max_long_partial_prefills needs long_prefill_token_threshold "
                             "> 0 (it defines a long prompt)")
    parse_tenant_weights(o.tenant_weights)
    for name in ("static_batch_size", "kv_cache_bytes"):
        if getattr(o, name) is not None and getattr(o, name) < 1:
            raise ValueError(f"{name} must be >= 1, got {getattr(o, name)}")
    if o.num_kv_blocks is not None and o.num_kv_blocks < 2:
        raise ValueError(f"num_kv_blocks must be >= 2 (one is the reserved null block), "
                         f"got {o.num_kv_blocks}")
    if not 1 <= o.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
        raise ValueError(f"num_speculative_tokens must be in [1, "
                         f"{MAX_SPECULATIVE_TOKENS}], got {o.num_speculative_tokens}")
    if (o.speculative == "draft") != (o.draft_engine is not None):
        raise ValueError("speculative=draft needs draft_engine (the draft model's engine "
                         "folder), and draft_engine needs speculative=draft; got "
                         f"speculative={o.speculative!r}, "
                         f"draft_engine={o.draft_engine!r}")
    check_lora_options(o)
    check_tier_options(o)


def check_tier_options(o: EngineOptions) -> None:
    """The KV tiers: byte budgets >= 0, and a disk folder exactly when a disk budget."""
    for name in ("kv_offload_bytes", "kv_disk_bytes"):
        value = getattr(o, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be an integer >= 0 (0: off), got {value!r}")
    if o.kv_disk_dir is not None and not o.kv_disk_dir:
        raise ValueError("kv_disk_dir must be a folder path (or none), got ''")
    if (o.kv_disk_dir is None) != (o.kv_disk_bytes == 0):
        raise ValueError("the disk KV tier needs both kv_disk_dir and kv_disk_bytes > 0; got "
                         f"kv_disk_dir={o.kv_disk_dir!r}, kv_disk_bytes={o.kv_disk_bytes}")


def check_lora_options(o: EngineOptions) -> None:
    """The LoRA options: ``max_loras`` >= 1, ``max_lora_rank`` in [1, 256], adapter names
    as :func:`~kvflow.lora.adapter.check_lora_name` allows, and a runner that can apply
    adapters."""
    if isinstance(o.max_loras, bool) or not isinstance(o.max_loras, int) or o.max_loras < 1:
        raise ValueError(f"max_loras must be an integer >= 1, got {o.max_loras!r}")
    if not (isinstance(o.max_lora_rank, int) and not isinstance(o.max_lora_rank, bool)
            and 1 <= o.max_lora_rank <= MAX_LORA_RANK):
        raise ValueError(f"max_lora_rank must be an integer in [1, {MAX_LORA_RANK}], got "
                         f"{o.max_lora_rank!r}")
    for name, path in o.lora_modules.items():
        try:
            check_lora_name(name)
        except ValueError as e:
            raise ValueError(f"lora_modules: {e}") from None
        if not isinstance(path, str) or not path:
            raise ValueError(f"lora_modules: adapter {name!r} needs a path, got {path!r}")
    if o.lora_enabled and o.runner in NO_LORA_RUNNERS:
        raise ValueError(f"LoRA adapters (enable_lora, lora_modules) cannot run on the "
                         f"{o.runner} runner: its engine graph has no LoRA op; use onnxruntime, "
                         "torch or triton")


def parse_tenant_weights(text: str) -> dict[str, float]:
    """``tenant_weights`` ('name=weight,...') as a dict, refusing a bad entry by name."""
    weights: dict[str, float] = {}
    for entry in filter(None, (e.strip() for e in text.split(","))):
        name, sep, value = entry.rpartition("=")
        try:
            weight = float(value) if sep and name else float("nan")
        except ValueError:
            weight = float("nan")
        if not weight > 0 or weight == float("inf"):
            raise ValueError(f"tenant_weights: {entry!r} must be 'name=weight' with a weight "
                             "> 0")
        weights[name.strip()] = weight
    return weights
