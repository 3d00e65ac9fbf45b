"""``kvflow generate``: a tritonclient gRPC streaming client that prints text as it arrives."""

from __future__ import annotations

import argparse
import json
import queue
import sys
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvflow import envs
from kvflow.triton_backend.protocol import GRPC_API_KEY_HEADER, MODEL_NAME
from kvflow.utils.args import int_arg


@dataclass
class StreamChunk:
    text: str
    finish_reason: str
    num_input_tokens: int
    num_output_tokens: int
    cached_tokens: int
    # Speculative decoding (a server with --speculative): drafts verified, and accepted.
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


def infer_inputs(arrays: Mapping[str, np.ndarray]) -> list[Any]:
    """tritonclient gRPC input tensors, named as ``arrays`` and typed from their dtypes."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import np_to_triton_dtype

    tensors = []
    for name, value in arrays.items():
        tensor = grpcclient.InferInput(name, list(value.shape), np_to_triton_dtype(value.dtype))
        tensor.set_data_from_numpy(value)
        tensors.append(tensor)
    return tensors


def build_inputs(prompt: str, sampling: dict[str, Any], stream: bool = True,
                 exclude_input: bool = True, chat: bool = False) -> list[Any]:
    """The request tensors of Triton's vLLM-backend protocol."""
    return infer_inputs({
        "text_input": np.array([prompt.encode()], dtype=np.object_),
        "stream": np.array([stream]),
        "exclude_input_in_output": np.array([exclude_input]),
        "sampling_parameters": np.array([json.dumps(sampling).encode()], dtype=np.object_),
        "apply_chat_template": np.array([chat]),
    })


class StreamingClient:
    """One gRPC connection and bidirectional stream, reused for request after request."""

    def __init__(self, url: str, timeout_s: float = 600.0, api_key: str | None = None) -> None:
        import tritonclient.grpc as grpcclient

        self.timeout_s = timeout_s
        self._responses: queue.Queue[Any] = queue.Queue()
        self._client = grpcclient.InferenceServerClient(url)
        self._client.start_stream(
            callback=lambda result, error: self._responses.put((result, error)),
            headers={GRPC_API_KEY_HEADER: api_key} if api_key else None)

    def generate(self, prompt: str, sampling: dict[str, Any], stream: bool = True,
                 chat: bool = False, request_id: str | None = None) -> Iterator[StreamChunk]:
        """Yield the responses of one request (requests on one client run one at a time);
        ``request_id``: Triton's request id (default: a random one)."""
        self._client.async_stream_infer(MODEL_NAME, build_inputs(prompt, sampling, stream,
                                                                 chat=chat),
                                        request_id=request_id or uuid.uuid4().hex,
                                        enable_empty_final_response=True)
        while True:
            result, error = self._responses.get(timeout=self.timeout_s)
            if error is not None:
                raise RuntimeError(str(error))
            final = result.get_response().parameters.get("triton_final_response")
            if result.as_numpy("text_output") is not None:
                yield StreamChunk(
                    text=result.as_numpy("text_output")[0].decode("utf-8"),
                    finish_reason=result.as_numpy("finish_reason")[0].decode(),
                    num_input_tokens=int(result.as_numpy("num_input_tokens")[0]),
                    num_output_tokens=int(result.as_numpy("num_output_tokens")[0]),
                    cached_tokens=int(result.as_numpy("cached_tokens")[0]),
                    num_draft_tokens=_count(result, "num_draft_tokens"),
                    num_accepted_tokens=_count(result, "num_accepted_tokens"),
                )
            if final is not None and final.bool_param:
                return

    def close(self) -> None:
        self._client.stop_stream(cancel_requests=True)
        self._client.close()

    def __enter__(self) -> StreamingClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _count(result: Any, name: str) -> int:
    """An optional count output (0 when the server sends none)."""
    value = result.as_numpy(name)
    return int(value[0]) if value is not None else 0


def stream_generate(url: str, prompt: str, sampling: dict[str, Any], stream: bool = True,
                    chat: bool = False, timeout_s: float = 600.0,
                    api_key: str | None = None,
                    request_id: str | None = None) -> Iterator[StreamChunk]:
    """Yield the server's responses for one request over its own gRPC stream."""
    with StreamingClient(url, timeout_s, api_key) as client:
        yield from client.generate(prompt, sampling, stream, chat, request_id)


def add_args(p: argparse.ArgumentParser) -> None:
    """``kvflow generate``'s flags: the prompt, the server, the sampling parameters."""
    p.add_argument("--prompt", required=True)
    p.add_argument("--url", default="localhost:8001", help="gRPC host:port")
    p.add_argument("--chat", action="store_true",
                   help="treat the prompt as a user message and apply the model's chat template")
    p.add_argument("--no-stream", action="store_true", help="one response at the end")
    p.add_argument("--max-tokens", type=int_arg, default=128)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--top-k", type=int_arg, default=0)
    p.add_argument("--seed", type=int_arg, default=None)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--lora-name", default=None,
                   help="run under this LoRA adapter (one the server has loaded)")
    p.add_argument("--api-key", default=envs.api_key(),
                   help="the server's --api-key (default: $KVFLOW_API_KEY)")


def main(args: argparse.Namespace) -> int:
    """Stream one completion to stdout; its finish reason and token counts to stderr."""
    sampling = {"max_tokens": args.max_tokens, "temperature": args.temperature,
                "top_p": args.top_p, "top_k": args.top_k}
    if args.seed is not None:
        sampling["seed"] = args.seed
    if args.stop:
        sampling["stop"] = args.stop
    if args.lora_name:  # where Triton's vLLM backend takes it too
        sampling["lora_name"] = args.lora_name
    last = None
    for chunk in stream_generate(args.url, args.prompt, sampling, stream=not args.no_stream,
                                 chat=args.chat, api_key=args.api_key):
        sys.stdout.write(chunk.text)
        sys.stdout.flush()
        last = chunk
    sys.stdout.write("\n")
    if last is not None:
        print(f"[{last.finish_reason}: {last.num_input_tokens} prompt tokens, "
              f"{last.num_output_tokens} output tokens]", file=sys.stderr)
    return 0
