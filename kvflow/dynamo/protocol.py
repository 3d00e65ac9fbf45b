"""Dynamo's token-in, token-out request and response, in kvflow's terms. No Dynamo import.

Dynamo's frontend tokenizes (chat template included), so a worker gets a *preprocessed* request:
``token_ids``, ``sampling_options``, ``stop_conditions`` and ``output_options``. The frontend's
decoder turns the token ids the worker streams back into text and applies the text-level stops
(``stop`` strings); ``lora_name`` (or a ``model`` that names a loaded LoRA adapter) selects
an adapter. This module only renames fields: every value goes through
:meth:`SamplingParams.from_dict`, the one validation that the Triton backend and the OpenAI
front door use too, so a bad value gets the same error naming the field and its limit.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

from kvflow.build.engine_config import EngineConfig
from kvflow.orchestrator.outputs import RequestOutput
from kvflow.orchestrator.sampling.params import SamplingParams

# sampling_options key -> SamplingParams field. Dynamo sends absent options as null.
SAMPLING_OPTIONS = {
    "n": "n", "temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
    "min_p": "min_p", "seed": "seed", "repetition_penalty": "repetition_penalty",
    "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
}
# Options that change nothing in kvflow when given at their neutral value.
NEUTRAL_OPTIONS = {"best_of": (None, 1), "use_beam_search": (None, False),
                   "length_penalty": (None, 1.0), "include_stop_str_in_output": (None, False)}
# guided_decoding key -> vLLM's guided_* name that SamplingParams.from_dict takes.
GUIDED = {"json": "guided_json", "regex": "guided_regex", "choice": "guided_choice",
          "grammar": "guided_grammar"}
GUIDED_IGNORED = ("backend", "whitespace_pattern")


def _unsupported(field: str, value: Any) -> ValueError:
    return ValueError(f"{field} is not supported by kvflow (got {value!r})")


def sampling_params_from(request: Mapping[str, Any]) -> SamplingParams:
    """The kvflow :class:`SamplingParams` of a Dynamo preprocessed request.

    ``stop_conditions``: ``max_tokens``, ``min_tokens``, ``ignore_eos`` and the stop token ids
    (Dynamo's ``stop_token_ids_hidden`` carries the model's EOS ids; kvflow stops on its own
    EOS too). ``stop`` strings are left to the frontend's decoder, which cuts the text and
    ends the stream: the worker then sees a cancellation and frees the request's blocks.

    Raises:
        ValueError: naming the field, for an option kvflow does not have or a bad value.
    """
    options = request.get("sampling_options") or {}
    stops = request.get("stop_conditions") or {}
    d: dict[str, Any] = {}
    for key, value in options.items():
        if value is None:
            continue
        if key in SAMPLING_OPTIONS:
            d[SAMPLING_OPTIONS[key]] = value
        elif key == "guided_decoding":
            d.update(_guided(value))
        elif key in NEUTRAL_OPTIONS:
            if value not in NEUTRAL_OPTIONS[key]:
                raise _unsupported(f"sampling_options.{key}", value)
        else:
            raise _unsupported(f"sampling_options.{key}", value)
    if stops.get("max_tokens") is not None:
        d["max_tokens"] = stops["max_tokens"]
    else:
        d["max_tokens"] = None  # until the context is full, as the OpenAI API means it
    if stops.get("min_tokens") is not None:
        d["min_tokens"] = stops["min_tokens"]
    if stops.get("ignore_eos") is not None:
        d["ignore_eos"] = stops["ignore_eos"]
    stop_ids = [*(stops.get("stop_token_ids_hidden") or ()), *(stops.get("stop_token_ids") or ())]
    if stop_ids:
        d["stop_token_ids"] = sorted(set(stop_ids))
    logprobs = (request.get("output_options") or {}).get("logprobs")
    if logprobs is not None:
        d["logprobs"] = logprobs
    return SamplingParams.from_dict(d)


def _guided(value: Any) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise ValueError(f"sampling_options.guided_decoding must be an object, got {value!r}")
    out = {}
    for key, spec in value.items():
        if spec is None or key in GUIDED_IGNORED:
            continue
        if key not in GUIDED:
            raise _unsupported(f"sampling_options.guided_decoding.{key}", spec)
        out[GUIDED[key]] = spec
    return out


def cache_salt_of(request: Mapping[str, Any]) -> str | None:
    """The request's cache salt: Dynamo's routing hint, else ``extra_args.nvext``."""
    routing = request.get("routing") or {}
    if isinstance(routing, Mapping) and routing.get("cache_salt"):
        return str(routing["cache_salt"])
    extra = request.get("extra_args") or {}
    nvext = extra.get("nvext") if isinstance(extra, Mapping) else None
    if isinstance(nvext, Mapping) and nvext.get("cache_salt"):
        return str(nvext["cache_salt"])
    return None


def lora_name_of(request: Mapping[str, Any], adapters: Collection[str]) -> str | None:
    """The LoRA adapter a request runs under (None: the base model): ``lora_name`` given
    explicitly (on the request, in ``extra_args`` or ``extra_args.nvext``; the engine refuses
    a name it does not hold, naming it), else the request's ``model`` when it names one of
    ``adapters`` (the adapters loaded: a client that asks for an adapter by model name)."""
    extra = request.get("extra_args") or {}
    nvext = extra.get("nvext") if isinstance(extra, Mapping) else None
    for where in (request, extra, nvext):
        if isinstance(where, Mapping) and where.get("lora_name") is not None:
            name = where["lora_name"]
            if not isinstance(name, str):
                raise ValueError(f"lora_name must be a string, got {name!r}"[:200])
            return name or None
    model = request.get("model")
    return model if isinstance(model, str) and model in adapters else None


def tenant_of(request: Mapping[str, Any]) -> str | None:
    """The fair-share tenant: ``extra_args.user`` where the frontend forwards it."""
    extra = request.get("extra_args") or {}
    user = extra.get("user") if isinstance(extra, Mapping) else None
    return user if isinstance(user, str) and user else None


def usage_of(out: RequestOutput) -> dict[str, Any]:
    """``completion_usage`` of a final chunk, with the prefix-cache hit as OpenAI reports it."""
    completion = out.num_output_tokens
    usage: dict[str, Any] = {
        "prompt_tokens": out.num_prompt_tokens, "completion_tokens": completion,
        "total_tokens": out.num_prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": out.cached_tokens}}
    if out.num_draft_tokens:  # speculative decoding, in OpenAI's words for predicted outputs
        usage["completion_tokens_details"] = {
            "accepted_prediction_tokens": out.num_accepted_tokens,
            "rejected_prediction_tokens": out.num_draft_tokens - out.num_accepted_tokens}
    return usage


# kvflow's finish reasons in Dynamo's vocabulary (an unknown one is an HTTP 500 there). Dynamo
# has no "timeout": a request past its deadline ends as "length", with the output it has.
FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "cancelled",
                  "timeout": "length"}


def chunks_of(out: RequestOutput, ended: set[int]) -> list[dict[str, Any]]:
    """The response chunks of one engine output: one per sequence that produced tokens or
    ended in it, ``index`` its choice index. A sequence's chunk carries its ``finish_reason``
    once, in the output where it ended: ``ended`` holds the indices already told (the caller
    keeps it across a request's outputs). The request's last chunk has ``completion_usage``."""
    chunks: list[dict[str, Any]] = []
    for seq in out.outputs:
        # The reason this output ends the sequence with, None if it does not (or was told).
        ends = seq.finish_reason if seq.index not in ended else None
        if not seq.delta_token_ids and ends is None:
            continue
        chunk: dict[str, Any] = {"token_ids": list(seq.delta_token_ids), "index": seq.index}
        if ends is not None:
            ended.add(seq.index)
            chunk["finish_reason"] = FINISH_REASONS[ends]
        if seq.logprobs and seq.delta_token_ids:
            recent = seq.token_logprobs(seq.num_tokens - len(seq.delta_token_ids))
            if recent and all(lp.logprob is not None for lp in recent):
                chunk["log_probs"] = [lp.logprob for lp in recent]
                chunk["top_logprobs"] = [
                    [{"rank": rank, "token_id": tid, "logprob": value}
                     for rank, (tid, value) in enumerate(lp.top, 1)] for lp in recent]
        chunks.append(chunk)
    if out.finished:
        if not chunks:
            chunks.append({"token_ids": [], "index": 0, "finish_reason": "stop"})
        chunks[-1]["completion_usage"] = usage_of(out)
    return chunks


def write_model_card(engine: EngineConfig, engine_dir: str | Path, dest: str | Path,
                     context_length: int) -> Path:
    """A Hugging Face-style folder that Dynamo's frontend loads the tokenizer, the chat
    template and the context length from (``config.json``, ``generation_config.json``, the
    tokenizer files of the engine folder). Nothing is fetched: the frontend reads this folder.
    """
    src, out = Path(engine_dir), Path(dest)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = src / "tokenizer.json"
    if not tokenizer.is_file():
        raise ValueError(f"engine folder {src} has no tokenizer.json: Dynamo's frontend "
                         "tokenizes, so the worker needs one")
    (out / "tokenizer.json").write_bytes(tokenizer.read_bytes())
    tok_cfg: dict[str, Any] = {}
    if (src / "tokenizer_config.json").is_file():
        tok_cfg = json.loads((src / "tokenizer_config.json").read_text())
    if (src / "chat_template.jinja").is_file():
        tok_cfg["chat_template"] = (src / "chat_template.jinja").read_text()
    tok_cfg["model_max_length"] = context_length
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=1))
    m = engine.model
    eos = list(m.eos_token_ids)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
              "vocab_size": m.vocab_size, "hidden_size": m.hidden_size,
              "intermediate_size": m.intermediate_size,
              "num_hidden_layers": m.num_hidden_layers,
              "num_attention_heads": m.num_attention_heads,
              "num_key_value_heads": m.num_key_value_heads, "head_dim": m.head_dim,
              "max_position_embeddings": context_length,
              "bos_token_id": m.bos_token_id, "eos_token_id": eos[0] if len(eos) == 1 else eos,
              "tie_word_embeddings": m.tie_word_embeddings}
    (out / "config.json").write_text(json.dumps(config, indent=1))
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": m.bos_token_id, "eos_token_id": eos}, indent=1))
    return out
