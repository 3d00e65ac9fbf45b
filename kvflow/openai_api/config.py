"""The OpenAI frontend's configuration (:class:`FrontendConfig`) and the command-line flags it
comes from (``kvflow openai``; ``kvflow serve`` shares the chat-format and console flags)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from kvflow.openai_api.reasoning import REASONING_PARSERS
from kvflow.openai_api.tool_parsers import TOOL_PARSERS


@dataclass(frozen=True)
class FrontendConfig:
    """Where the frontend listens and which tritonservers (gRPC ``host:port``) it uses."""

    triton_urls: tuple[str, ...]
    host: str = "127.0.0.1"
    port: int = 9000
    served_model_name: str | None = None  # default: what the servers' model config names
    metrics_urls: tuple[str, ...] = ()  # the servers' Prometheus endpoints, for /metrics
    api_key: str | None = None  # clients send `Authorization: Bearer KEY`; passed on to Triton
    # How tool calls are read out of chat outputs: a TOOL_PARSERS name, or "auto" (the format
    # of the engine's chat template, which the server's model config names).
    tool_call_parser: str = "auto"
    # How reasoning is split into reasoning_content: a REASONING_PARSERS name, "auto" (the
    # engine's chat template's format, which the server's model config names), None: not split.
    reasoning_parser: str | None = "auto"
    # /v1/kvflow/state shows tenants (`user`) and request ids as they are, not hashed.
    console_show_tenants: bool = False
    # /v1/responses' store: a SQLite file that outlives the process (None: in memory), and
    # its bounds over every key's responses together (the least recently used go first).
    responses_store: str | None = None
    responses_store_max_count: int = 10_000
    responses_store_max_bytes: int = 256 << 20

    def __post_init__(self) -> None:
        if self.tool_call_parser not in ("auto", *TOOL_PARSERS):
            raise ValueError(f"--tool-call-parser must be auto or one of "
                             f"{', '.join(TOOL_PARSERS)}, got {self.tool_call_parser!r}")
        if self.reasoning_parser == "none":  # the flag's word for None (kvflow serve passes it)
            object.__setattr__(self, "reasoning_parser", None)
        if self.reasoning_parser not in (None, "auto", *REASONING_PARSERS):
            raise ValueError(f"--reasoning-parser must be auto, none or one of "
                             f"{', '.join(REASONING_PARSERS)}, got {self.reasoning_parser!r}")
        if self.responses_store_max_count < 1:
            raise ValueError(f"--responses-store-max-count must be at least 1, got "
                             f"{self.responses_store_max_count}")
        if self.responses_store_max_bytes < 1024:
            raise ValueError(f"--responses-store-max-bytes must be at least 1024, got "
                             f"{self.responses_store_max_bytes}")
        if not self.triton_urls:
            raise ValueError("--triton-url must name at least one tritonserver (host:port)")
        for url in self.triton_urls:
            host, _, port = url.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"--triton-url must be host:port, got {url!r}")
        if not 0 < self.port < 65536:
            raise ValueError(f"--port must be in [1, 65535], got {self.port}")


def add_args(p: argparse.ArgumentParser) -> None:
    """``kvflow openai``'s flags."""
    p.add_argument("--triton-url", default="127.0.0.1:8001",
                   help="gRPC host:port of the tritonserver(s), comma-separated")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (loopback)")
    p.add_argument("--port", type=int, default=9000)
    p.add_argument("--served-model-name", default=None, type=served_model_name_arg,
                   help="the model's name in the API (default: the engine's, from the server)")
    p.add_argument("--metrics-url", default="",
                   help="Prometheus endpoint(s) of the server(s), comma-separated, passed "
                        "through by /metrics")
    p.add_argument("--api-key", default=None,
                   help="require `Authorization: Bearer KEY` (default: $KVFLOW_API_KEY)")
    add_chat_format_args(p)
    add_console_args(p)
    add_responses_args(p)


def add_chat_format_args(p: argparse.ArgumentParser) -> None:
    """The flags that say how chat outputs are read (``kvflow openai`` and ``kvflow serve``)."""
    p.add_argument("--tool-call-parser", default="auto", choices=("auto", *TOOL_PARSERS),
                   help="how tool calls are read out of chat outputs (default: the format of "
                        "the engine's chat template; hermes for kvflow's fallback prompt)")
    p.add_argument("--reasoning-parser", default="auto",
                   choices=("auto", "none", *REASONING_PARSERS),
                   help="split the model's reasoning (<think>...</think>) into "
                        "reasoning_content (default: auto, the format of the engine's chat "
                        "template, none when it has none)")


def add_responses_args(p: argparse.ArgumentParser) -> None:
    """The flags of ``/v1/responses``' store (``kvflow openai``)."""
    p.add_argument("--responses-store", default=None, metavar="PATH",
                   help="keep stored responses (store: true) in this SQLite file, so that "
                        "previous_response_id works across restarts (default: in memory)")
    p.add_argument("--responses-store-max-count", type=int, default=10_000,
                   help="at most this many stored responses, every key's together; the least "
                        "recently used go first")
    p.add_argument("--responses-store-max-bytes", type=int, default=256 << 20,
                   help="at most this many bytes of stored responses (JSON), every key's "
                        "together; the least recently used go first")


def add_console_args(p: argparse.ArgumentParser) -> None:
    """The console's flags (``kvflow openai`` and ``kvflow serve``)."""
    p.add_argument("--console-show-tenants", action="store_true",
                   help="/v1/kvflow/state (and the console) show tenants (`user`) and request "
                        "ids as they are (default: hashed, so that a key holder does not see "
                        "the others')")


def config_from_args(args: argparse.Namespace) -> FrontendConfig:
    """The configuration ``kvflow openai``'s flags give (the key: ``$KVFLOW_API_KEY``)."""
    from kvflow import envs

    return FrontendConfig(
        tuple(u.strip() for u in args.triton_url.split(",") if u.strip()), args.host,
        args.port, args.served_model_name,
        tuple(u.strip() for u in args.metrics_url.split(",") if u.strip()),
        args.api_key or envs.api_key(), args.tool_call_parser,
        None if args.reasoning_parser == "none" else args.reasoning_parser,
        args.console_show_tenants, args.responses_store, args.responses_store_max_count,
        args.responses_store_max_bytes)


def served_model_name_arg(text: str) -> str:
    if not text or len(text) > 256 or not text.isprintable():
        raise argparse.ArgumentTypeError("--served-model-name must be 1-256 printable "
                                         "characters")
    return text
