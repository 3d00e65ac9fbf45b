"""``kvflow.LLM``: offline generation over an engine folder (vLLM's ``LLM`` API)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvflow.build.engine_config import EngineConfig
from kvflow.orchestrator.engine import LLMEngine
from kvflow.orchestrator.memory_budget import (
    HOST_RUNNERS,
    MemoryBudget,
    available_host_memory,
    size_pool,
    weights_bytes,
)
from kvflow.orchestrator.options import EngineOptions
from kvflow.orchestrator.options_check import NO_LORA_RUNNERS
from kvflow.orchestrator.outputs import RequestOutput
from kvflow.orchestrator.sampling.params import SamplingParams
from kvflow.runtime.base import kv_bytes_per_block, resolve_kv_cache_dtype
from kvflow.runtime.lora_pool import pool_bytes
from kvflow.text.tokenizer import ChatPrompt, EngineTokenizer, Prompt

logger = logging.getLogger(__name__)

def memory_budget(engine_dir: str | Path, engine: EngineConfig, options: EngineOptions,
                  kv_dtype: str) -> MemoryBudget:
    """The KV pool and swap space in blocks, sized from memory
    (:mod:`kvflow.orchestrator.memory_budget`): ``num_kv_blocks``, or what ``kv_cache_bytes``
    holds, or what ``max_num_seqs`` full-length sequences could use capped by
    ``kv_cache_memory_fraction`` of the memory the weights leave; in ``kv_dtype`` (the
    resolved ``kv_cache_dtype``). With LoRA on, the slot pool's bytes are set aside first;
    on a host runner, so is the host KV tier (``kv_offload_bytes``, with the prefix cache)."""
    per_block = kv_bytes_per_block(engine, kv_dtype)
    host = (options.runner or engine.backend) in HOST_RUNNERS
    return size_pool(weights=weights_bytes(engine_dir, engine.files),
                     available=available_host_memory() if host else None,
                     bytes_per_block=per_block, block_size=engine.limits.block_size,
                     max_model_len=options.max_model_len, max_num_seqs=options.max_num_seqs,
                     fraction=options.kv_cache_memory_fraction,
                     kv_cache_bytes=options.kv_cache_bytes, num_kv_blocks=options.num_kv_blocks,
                     swap_bytes=options.swap_space_bytes,
                     lora_bytes=pool_bytes(engine.model, options.max_loras,
                                           options.max_lora_rank) if options.lora_enabled else 0,
                     host_tier_bytes=options.kv_offload_bytes if options.enable_prefix_caching
                     else 0)


@dataclass(frozen=True)
class EnginePlan:
    """What :func:`create_engine` builds from an engine folder and overrides: the options,
    the KV pool sizes, the KV element type (``auto`` resolved) and the runner. The simulator
    reads it to model a served engine exactly as configured."""

    engine: EngineConfig
    scheduler: EngineOptions
    num_blocks: int
    num_host_blocks: int
    kv_cache_dtype: str
    budget: MemoryBudget

    @property
    def runner(self) -> str | None:
        return self.scheduler.runner

    @property
    def cuda_graphs(self) -> bool | None:
        return self.scheduler.cuda_graphs


def plan_engine(engine_dir: str | Path, **overrides: Any) -> EnginePlan:
    """Resolve ``overrides`` (any :class:`EngineOptions` field) against ``engine_dir``'s build
    limits; unknown options and bad values are refused by name."""
    engine = EngineConfig.load(engine_dir)
    limits = engine.limits
    base = EngineOptions(max_num_seqs=limits.max_batch_size,
                         max_num_batched_tokens=limits.max_num_tokens,
                         max_model_len=limits.max_model_len)
    options = base.with_overrides(**overrides)
    for name, limit in (("max_num_seqs", limits.max_batch_size),
                        ("max_num_batched_tokens", limits.max_num_tokens),
                        ("max_model_len", limits.max_model_len)):
        if getattr(options, name) > limit:
            raise ValueError(f"{name}={getattr(options, name)} exceeds the engine's build limit "
                             f"of {limit}")
    if options.lora_enabled and (options.runner or engine.backend) in NO_LORA_RUNNERS:
        raise ValueError(f"LoRA adapters (enable_lora, lora_modules) cannot run on the "
                         f"{options.runner or engine.backend} runner (the engine's backend); "
                         "choose runner onnxruntime, torch or triton")
    kv_dtype = resolve_kv_cache_dtype(options.kv_cache_dtype, engine, options.runner)
    budget = memory_budget(engine_dir, engine, options, kv_dtype)
    return EnginePlan(engine, options, budget.num_blocks, budget.num_host_blocks, kv_dtype,
                      budget)


def create_engine(engine_dir: str | Path, **overrides: Any) -> LLMEngine:
    """An :class:`LLMEngine` over ``engine_dir``; ``overrides``: any :class:`EngineOptions`
    field (scheduler limits and policy, KV pool sizes, ``runner``, ``cuda_graphs``,
    ``debug_checks``; LoRA: the runner's slot pool, and ``lora_modules`` loaded, an adapter
    that fails to load an error naming it)."""
    from kvflow.runtime import create_runner  # the one place that reaches the runtimes

    plan = plan_engine(engine_dir, **overrides)
    logger.info("kvflow %s: %s", Path(engine_dir).name, plan.budget.describe())
    options = plan.scheduler
    # A runner whose graph holds the LoRA op makes its slot pool as it is built.
    lora = ({"max_loras": options.max_loras, "max_lora_rank": options.max_lora_rank}
            if options.lora_enabled else {})
    runner = create_runner(plan.runner, engine_dir, plan.num_blocks, plan.num_host_blocks,
                           cuda_graphs=plan.cuda_graphs,
                           quantized_matmul=options.quantized_matmul,
                           kv_cache_dtype=plan.kv_cache_dtype, **lora)
    proposer = None
    try:
        proposer = draft_proposer(plan, runner) if plan.scheduler.draft_engine else None
        engine = LLMEngine(runner, EngineTokenizer(engine_dir), plan.scheduler,
                           plan.engine.model.eos_token_ids, proposer=proposer)
    except BaseException:
        if proposer is not None:
            proposer.close()
        runner.close()
        raise
    engine.memory_budget = plan.budget
    return engine


def draft_proposer(plan: EnginePlan, target: Any) -> Any:
    """``speculative=draft``: the draft engine's runner (its default arithmetic, a KV pool of
    the target's size in blocks, no swap space) behind a
    :class:`~kvflow.orchestrator.speculative.draft_model.DraftModelProposer`. The draft must
    share the target's tokenizer (its vocabulary is checked) and block size."""
    from kvflow.orchestrator.speculative.draft_model import DraftModelProposer
    from kvflow.runtime import create_runner

    path = plan.scheduler.draft_engine
    assert path is not None
    draft = EngineConfig.load(path)
    if draft.limits.block_size != plan.engine.limits.block_size:
        raise ValueError(f"draft_engine: its block size ({draft.limits.block_size}) is not "
                         f"the target's ({plan.engine.limits.block_size})")
    if draft.limits.max_model_len < plan.scheduler.max_model_len:
        raise ValueError(f"draft_engine: its max_model_len ({draft.limits.max_model_len}) is "
                         f"below the target's ({plan.scheduler.max_model_len})")
    runner = create_runner(None, path, plan.num_blocks, 0, quantized_matmul="auto")
    try:
        return DraftModelProposer(runner, target.vocab_size, coupled=True)
    except BaseException:
        runner.close()
        raise


class LLM:
    """Offline batched generation: ``LLM(engine_dir, **overrides).generate(prompts, params)``.

    ``overrides``: any :class:`~kvflow.orchestrator.options.EngineOptions` field; an unknown one
    is refused with the list of known ones.
    """

    def __init__(self, engine_dir: str | Path, **overrides: Any) -> None:
        self.engine = create_engine(engine_dir, **overrides)
        self.tokenizer = self.engine.tokenizer

    def generate(self, prompts: str | ChatPrompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 priorities: Sequence[int] | None = None,
                 cache_salts: Sequence[str | None] | None = None,
                 lora: str | Sequence[str | None] | None = None) -> list[RequestOutput]:
        """Generate for every prompt (text, token ids or a :class:`ChatPrompt`); outputs in
        prompt order, each with its ``n`` sequences in ``outputs[j]`` (vLLM's shape).

        ``cache_salts``: per prompt; prompts with different salts share no prefix-cache blocks.
        ``lora``: the LoRA adapter every prompt runs under, or one per prompt (None: the base
        model); an adapter not loaded is refused before any prompt runs.
        A request's ``prompt_logprobs`` (it asked: ``SamplingParams.prompt_logprobs``) are on
        its final output, as vLLM's.
        """
        if isinstance(prompts, str | ChatPrompt):
            prompts = [prompts]
        n = len(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or SamplingParams()] * n
        else:
            params_list = list(sampling_params)
            if len(params_list) != n:
                raise ValueError(f"got {len(params_list)} sampling_params for {n} prompts")
        loras = [lora] * n if lora is None or isinstance(lora, str) else list(lora)
        if len(loras) != n:
            raise ValueError(f"got {len(loras)} lora names for {n} prompts")
        for name in set(loras) - {None}:
            self.engine.lora_fields(name)  # refused now, before any request is queued
        results: dict[str, RequestOutput] = {}
        order = []
        for i, (prompt, params) in enumerate(zip(prompts, params_list, strict=True)):
            request, rejected = self.engine.add_request(
                prompt, params, priority=priorities[i] if priorities else 0,
                cache_salt=cache_salts[i] if cache_salts else None, lora_name=loras[i])
            order.append(request.parent_id)
            if rejected is not None:
                results[request.parent_id] = rejected
        prompt_logprobs = {}  # the engine's come on a request's first output with a token
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.prompt_logprobs is not None:
                    prompt_logprobs[out.request_id] = out.prompt_logprobs
                if out.finished:
                    results[out.request_id] = out
        for rid, entries in prompt_logprobs.items():
            results[rid].prompt_logprobs = entries
        return [results[rid] for rid in order]

    def load_lora(self, name: str, path: str | Path) -> None:
        """Load a LoRA adapter (a PEFT folder or a GGUF LoRA file) that ``generate(lora=name)``
        selects; the engine must have LoRA on (``enable_lora`` or ``lora_modules``)."""
        self.engine.add_lora(name, path)

    def unload_lora(self, name: str) -> None:
        """Unload a LoRA adapter (between ``generate`` calls no request uses it)."""
        self.engine.remove_lora(name)

    def list_loras(self) -> list[dict[str, Any]]:
        """The adapters loaded: name, path, rank, lora_id, slot, residency."""
        return self.engine.list_loras()

    def chat(self, messages: list[dict[str, Any]],
             sampling_params: SamplingParams | None = None,
             tools: list[dict[str, Any]] | None = None,
             chat_template_kwargs: dict[str, Any] | None = None) -> RequestOutput:
        """One chat turn, rendered with the model's chat template; ``tools``: OpenAI function
        tools offered to the model (:mod:`kvflow.text.chat_tools`); ``chat_template_kwargs``:
        more template variables (Qwen3's ``{"enable_thinking": False}``)."""
        return self.generate([ChatPrompt(messages, tools, chat_template_kwargs)],
                             sampling_params)[0]

    def close(self) -> None:
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
