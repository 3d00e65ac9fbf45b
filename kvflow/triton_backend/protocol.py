"""The names that both sides of tritonserver share: the launcher (:mod:`.launcher`), the
backend (:mod:`.model`) and the clients (:mod:`kvflow.client`, the OpenAI frontend's pool):
the model's name, the key headers, the request parameters kvflow adds, the files beside the
model.

Constants only, so that a client imports them without the launcher or the backend.
"""

from __future__ import annotations

MODEL_NAME = "kvflow"  # the model's name in Triton's repository and in every request

# Triton's endpoints that kvflow never uses, restricted with a random per-server key.
ADMIN_APIS = "shared-memory,model-repository,trace,logging"
ADMIN_HEADER = "kvflow-admin-key"
# With --api-key: what a client must authenticate for (health stays open for load balancers).
API_KEY_APIS = "inference,metadata,model-config,statistics"
API_KEY_HEADER = "x-api-key"
# Triton prefixes a restricted protocol's header over gRPC.
GRPC_API_KEY_HEADER = f"triton-grpc-protocol-{API_KEY_HEADER}"

# The request parameter (a bool) by which a client asks for a failed request's error as a final
# response carrying the outputs ``error`` (the message) and ``error_code`` (bad_request,
# overloaded or engine_error) instead of a Triton error: over gRPC streams a Triton error is a
# message alone, and the code must cross as data (the OpenAI frontend asks for it).
ERROR_OUTPUT_PARAMETER = "kvflow_error_output"
# The request parameter (a bool) that makes a request a tokenize (or, with input_ids alone, a
# detokenize) request: one response, token_ids and max_model_len (or text_output).
TOKENIZE_PARAMETER = "kvflow_tokenize"
# The request parameter (a bool) that asks for the engine's state snapshot
# (kvflow.console.state): one response, its JSON in the output ``state``.
STATE_PARAMETER = "kvflow_state"
# The request parameter (a string) that selects a LoRA adapter by name for a generate request
# (Triton's vLLM backend takes it in sampling_parameters, which kvflow accepts too).
LORA_NAME_PARAMETER = "lora_name"
# The request parameter (a JSON string) that loads, unloads or lists LoRA adapters:
# {"op": "load", "lora_name": N, "lora_path": P}, {"op": "unload", "lora_name": N} or
# {"op": "list"}. One response, its JSON in the output ``lora``: the adapters after the
# operation ({"enabled": bool, "loras": [...]}, each as LoraManager.info() gives it).
LORA_PARAMETER = "kvflow_lora"
LORA_OUTPUT = "lora"

# The model parameter that names the model for the OpenAI frontend (the launcher writes it).
SERVED_MODEL_NAME_PARAMETER = "served_model_name"
# The model parameters that tell the OpenAI frontend how the engine's chat template writes tool
# calls (a --tool-call-parser name) and whether it opens the reasoning in the prompt ("true").
TOOL_CALL_PARSER_PARAMETER = "tool_call_parser"
REASONING_STARTS_OPEN_PARAMETER = "reasoning_starts_open"
# The --reasoning-parser name the chat template implies ("" for none): `auto` resolves to it.
REASONING_PARSER_PARAMETER = "reasoning_parser"
CHAT_FORMAT_PARAMETERS = (TOOL_CALL_PARSER_PARAMETER, REASONING_STARTS_OPEN_PARAMETER,
                          REASONING_PARSER_PARAMETER)

# Files beside the model's config.pbtxt in the launcher's workspace.
# The engine folder and this environment's paths, written by the launcher, out of clients'
# sight (NOTE: model_repository/kvflow/1/model.py spells it too: it runs before kvflow can
# be imported).
SERVE_FILE = "serve.json"
# Written by the backend when its engine loop fails: what failed (`kvflow serve` then exits 1).
ENGINE_FAILED_FILE = "engine_failed.txt"
# Written by the backend: the pids of stubs whose SIGUSR1 writes the step timeline, one a line.
TRACE_SIGNAL_FILE = "trace_signal.pids"
