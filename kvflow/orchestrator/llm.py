"""``kvflow.LLM``: offline generation over an engine folder (vLLM's ``LLM`` API)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvflow.build.engine_config import EngineConfig
from kvflow.kv_manager import KVCacheSpec
from kvflow.orchestrator.config import SchedulerConfig
from kvflow.orchestrator.engine import LLMEngine
from kvflow.orchestrator.outputs import RequestOutput
from kvflow.orchestrator.sampling_params import SamplingParams
from kvflow.orchestrator.tokenizer import EngineTokenizer

DEFAULT_KV_CACHE_BYTES = 1 << 30
DEFAULT_SWAP_SPACE_BYTES = 256 << 20

ENGINE_OPTIONS = ("runner", "kv_cache_bytes", "num_kv_blocks", "swap_space_bytes",
                  "cuda_graphs")


def kv_blocks_for(engine: EngineConfig, sched: SchedulerConfig, kv_cache_bytes: int | None,
                  num_kv_blocks: int | None) -> int:
    """Pool size in blocks: given, or what ``kv_cache_bytes`` holds, capped at what
    ``max_num_seqs`` full-length sequences could ever use."""
    if num_kv_blocks is not None:
        if num_kv_blocks < 2:
            raise ValueError(f"num_kv_blocks must be >= 2, got {num_kv_blocks}")
        return num_kv_blocks
    m, bs = engine.model, engine.limits.block_size
    spec = KVCacheSpec(m.num_hidden_layers, m.num_key_value_heads, m.head_dim, bs,
                       engine.dtype_bytes)
    by_bytes = spec.num_blocks_for_bytes(kv_cache_bytes or DEFAULT_KV_CACHE_BYTES)
    needed = sched.max_num_seqs * -(-sched.max_model_len // bs) + 1
    return min(by_bytes, needed)


@dataclass(frozen=True)
class EnginePlan:
    """What :func:`create_engine` builds from an engine folder and overrides: the scheduler
    config, the KV pool sizes and the runner. The simulator reads it to model a served engine
    exactly as configured."""

    engine: EngineConfig
    scheduler: SchedulerConfig
    num_blocks: int
    num_host_blocks: int
    runner: str | None
    cuda_graphs: bool | None = None


def plan_engine(engine_dir: str | Path, **overrides: Any) -> EnginePlan:
    """Resolve ``overrides`` (as :func:`create_engine` takes them) against ``engine_dir``'s
    build limits; bad values are refused by name."""
    engine = EngineConfig.load(engine_dir)
    engine_opts = {k: overrides.pop(k) for k in ENGINE_OPTIONS if k in overrides}
    limits = engine.limits
    base = SchedulerConfig(max_num_seqs=limits.max_batch_size,
                           max_num_batched_tokens=limits.max_num_tokens,
                           max_model_len=limits.max_model_len)
    sched = base.with_overrides(**overrides)
    for name, limit in (("max_num_seqs", limits.max_batch_size),
                        ("max_num_batched_tokens", limits.max_num_tokens),
                        ("max_model_len", limits.max_model_len)):
        if getattr(sched, name) > limit:
            raise ValueError(f"{name}={getattr(sched, name)} exceeds the engine's build limit "
                             f"of {limit}")
    num_blocks = kv_blocks_for(engine, sched, engine_opts.get("kv_cache_bytes"),
                               engine_opts.get("num_kv_blocks"))
    swap_bytes = engine_opts.get("swap_space_bytes", DEFAULT_SWAP_SPACE_BYTES)
    num_host_blocks = int(swap_bytes) // engine.kv_bytes_per_block
    return EnginePlan(engine, sched, num_blocks, num_host_blocks, engine_opts.get("runner"),
                      engine_opts.get("cuda_graphs"))


def create_engine(engine_dir: str | Path, **overrides: Any) -> LLMEngine:
    """An :class:`LLMEngine` over ``engine_dir``.

    ``overrides``: any :class:`SchedulerConfig` field, plus ``runner`` (default: the engine's
    backend), ``kv_cache_bytes`` or ``num_kv_blocks`` (KV pool size) and ``swap_space_bytes``
    (host swap pool for preemption by swap; default 256 MiB, 0 for none), ``cuda_graphs``
    (the triton runner's decode graphs; default: on a CUDA GPU).
    """
    from kvflow.runtime import create_runner  # the one place that reaches the runtimes

    plan = plan_engine(engine_dir, **overrides)
    runner = create_runner(plan.runner, engine_dir, plan.num_blocks, plan.num_host_blocks,
                           cuda_graphs=plan.cuda_graphs)
    return LLMEngine(runner, EngineTokenizer(engine_dir), plan.scheduler,
                     plan.engine.model.eos_token_ids)


class LLM:
    """Offline batched generation: ``LLM(engine_dir, **overrides).generate(prompts, params)``.

    ``overrides`` are those of :func:`create_engine` (scheduler options, ``runner``, KV size).
    """

    def __init__(self, engine_dir: str | Path, **overrides: Any) -> None:
        self.engine = create_engine(engine_dir, **overrides)
        self.tokenizer = self.engine.tokenizer

    def generate(self, prompts: str | Sequence[str] | Sequence[Sequence[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 priorities: Sequence[int] | None = None,
                 cache_salts: Sequence[str | None] | None = None) -> list[RequestOutput]:
        """Generate for every prompt (text, or token ids); outputs in prompt order.

        ``cache_salts``: per prompt; prompts with different salts share no prefix-cache blocks.
        """
        if isinstance(prompts, str):
            prompts = [prompts]
        n = len(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or SamplingParams()] * n
        else:
            params_list = list(sampling_params)
            if len(params_list) != n:
                raise ValueError(f"got {len(params_list)} sampling_params for {n} prompts")
        results: dict[str, RequestOutput] = {}
        order = []
        for i, (prompt, params) in enumerate(zip(prompts, params_list, strict=True)):
            request, rejected = self.engine.add_request(
                prompt, params, priority=priorities[i] if priorities else 0,
                cache_salt=cache_salts[i] if cache_salts else None)
            order.append(request.request_id)
            if rejected is not None:
                results[request.request_id] = rejected
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    results[out.request_id] = out
        return [results[rid] for rid in order]

    def chat(self, messages: list[dict[str, str]],
             sampling_params: SamplingParams | None = None) -> RequestOutput:
        """One chat turn, rendered with the model's chat template."""
        assert self.tokenizer is not None
        prompt = self.tokenizer.apply_chat_template(messages)
        ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        return self.generate([ids], sampling_params)[0]

    def close(self) -> None:
        self.engine.runner.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
