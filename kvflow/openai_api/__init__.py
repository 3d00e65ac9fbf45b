"""The OpenAI-compatible API in front of tritonserver (``kvflow openai``).

- ``fields``: the OpenAI body fields kvflow knows, their JSON types, those it ignores or
  does not serve.
- ``checks``: the body's JSON, fields, types and text, checked before it is translated.
- ``protocol``: an OpenAI request body -> one Triton request per choice.
- ``errors``: OpenAI's error shape; backend errors -> OpenAI errors.
- ``completion_bodies``: Triton responses -> completion bodies, SSE chunks, logprobs, usage.
- ``responses_request``, ``responses_body``, ``responses_stream``, ``response_store``: the
  Responses API (``/v1/responses``) over the chat path, and its store.
- ``tools``, ``tool_parsers``, ``tool_stream``, ``json_scan``, ``reasoning``, ``chat_output``:
  tool calling and reasoning: what a request's tools ask of the output, and a chat output read into
  ``reasoning_content``, ``content`` and ``tool_calls``.
- ``tokenize``: vLLM's ``/tokenize`` and ``/detokenize``.
- ``pool``: the gRPC aio clients of the servers, one stream per request; ``streaming``: their
  streams read whole or sent on as Server-Sent Events.
- ``security``: the API key, the console's token, JSON-only POSTs, hashed tenants in the state.
- ``config``: the frontend's configuration and its command-line flags.
- ``frontend``: what every route shares (auth, body, errors, model, store); ``generation``:
  a request's Triton streams; ``routes``: one module per endpoint family.
- ``app``: composes the routes into the FastAPI app; the ``kvflow openai`` command line.
- ``process``: the frontend as a child process.
"""

from kvflow.openai_api.config import FrontendConfig
from kvflow.openai_api.process import FrontendProcess

__all__ = ["FrontendConfig", "FrontendProcess"]
