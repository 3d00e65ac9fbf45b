"""The OpenAI frontend's routes, one module per endpoint family; each module's ``router(fe)``
returns its FastAPI router over the shared :class:`~kvflow.openai_api.frontend.Frontend`.

- ``completions``: ``POST /v1/completions``; ``chat``: ``POST /v1/chat/completions``;
- ``responses``: ``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{id}``;
- ``tokenize``: ``POST /tokenize`` and ``/detokenize`` (vLLM's);
- ``models``: ``GET /v1/models`` (the base, then each LoRA adapter);
- ``lora``: ``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` (vLLM's);
- ``console``: the console (``/``, ``/console/...``) and ``GET /v1/kvflow/state``;
- ``health``: ``GET /health`` and ``GET /metrics``.
"""
