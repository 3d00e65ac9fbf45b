"""``kvflow serve``: tritonserver on an engine folder, and the OpenAI frontend in front of it.

The command composes the two front doors: a :class:`~kvflow.triton_backend.launcher.TritonServer`
and (unless ``--no-openai``) a :class:`~kvflow.openai_api.process.FrontendProcess`, a gRPC client
of it. It prints how to query them, forwards signals (SIGUSR1 writes the step timeline), warns
when it listens beyond loopback, and exits 1 when the engine failed.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path
from typing import Any

from kvflow import envs
from kvflow.openai_api import FrontendConfig, FrontendProcess
from kvflow.openai_api.config import add_chat_format_args, add_console_args, add_responses_args
from kvflow.orchestrator.options import add_engine_option_args, engine_overrides
from kvflow.triton_backend.launcher import ServerConfig, TritonServer, served_model_name
from kvflow.triton_backend.protocol import API_KEY_HEADER, MODEL_NAME
from kvflow.utils.args import int_arg
from kvflow.utils.procs import ServeError, is_loopback, url_host


def add_args(p: argparse.ArgumentParser) -> None:
    """``kvflow serve``'s flags: where to listen, the key, the frontend, the engine options."""
    p.add_argument("--engine", default="engines/smollm2-135m", help="engine folder")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default loopback; 0.0.0.0 for every interface)")
    p.add_argument("--http-port", type=int_arg, default=8000)
    p.add_argument("--grpc-port", type=int_arg, default=8001)
    p.add_argument("--metrics-port", type=int_arg, default=8002)
    p.add_argument("--tritonserver", default=None,
                   help="tritonserver binary (default: the one in the nvidia-pytriton wheel)")
    p.add_argument("--log-verbose", type=int_arg, default=0)
    p.add_argument("--api-key", default=envs.api_key(),
                   help="clients must send the header 'x-api-key: KEY' for inference, metadata "
                        "and the model config (default: $KVFLOW_API_KEY; none: no "
                        "authentication, fine on loopback)")
    p.add_argument("--openai-port", type=int_arg, default=9000,
                   help="port of the OpenAI-compatible API (/v1/completions, "
                        "/v1/chat/completions, /v1/models), on --host")
    p.add_argument("--no-openai", action="store_true",
                   help="do not start the OpenAI-compatible frontend")
    p.add_argument("--served-model-name", default=None,
                   help="the model's name in the OpenAI API (default: the engine's checkpoint, "
                        "e.g. smollm2-135m-instruct)")
    add_chat_format_args(p)
    add_console_args(p)
    add_responses_args(p)
    add_engine_option_args(p)


def main(args: argparse.Namespace) -> int:
    """Run ``kvflow serve`` until SIGINT/SIGTERM; bad flags are a ValueError (exit 2)."""
    try:
        cfg = ServerConfig(args.engine, host=args.host, http_port=args.http_port,
                           grpc_port=args.grpc_port, metrics_port=args.metrics_port,
                           tritonserver=args.tritonserver, engine_args=engine_overrides(args),
                           log_verbose=args.log_verbose, api_key=args.api_key)
        served = args.served_model_name or served_model_name(cfg.engine_dir)
        if served in (cfg.engine_args.get("lora_modules") or {}):
            raise ServeError(f"--lora-modules {served}=...: that is the served model's name "
                             "(a request for it gets the base model); name the adapter apart")
        return serve_forever(cfg, openai_port=None if args.no_openai else args.openai_port,
                             served_model_name=args.served_model_name,
                             chat_format=(args.tool_call_parser, args.reasoning_parser),
                             console_show_tenants=args.console_show_tenants,
                             responses_store={
                                 "responses_store": args.responses_store,
                                 "responses_store_max_count": args.responses_store_max_count,
                                 "responses_store_max_bytes": args.responses_store_max_bytes})
    except ServeError as e:
        raise ValueError(str(e)) from None


def exposure_warnings(cfg: ServerConfig) -> list[str]:
    """What ``kvflow serve`` warns about when it binds beyond loopback."""
    if is_loopback(cfg.host):
        return []
    where = "every interface" if cfg.host in ("0.0.0.0", "::", "") else cfg.host
    out = [f"HTTP, gRPC, metrics and the OpenAI API listen on {where}, reachable from other "
           "machines."]
    if not cfg.api_key:
        out.append("no --api-key: anyone who can reach these ports can run inference; "
                   "set --api-key (or KVFLOW_API_KEY), or put an authenticating proxy in front.")
    out.append("the metrics port has no authentication (Triton offers none for it).")
    return out


def serve_forever(cfg: ServerConfig, openai_port: int | None = 9000,
                  served_model_name: str | None = None,
                  chat_format: tuple[str, str | None] = ("auto", None),
                  console_show_tenants: bool = False,
                  responses_store: dict[str, Any] | None = None) -> int:
    """``kvflow serve``: start tritonserver and (unless ``openai_port`` is None) the OpenAI
    frontend (``chat_format``: its tool-call and reasoning parsers; ``console_show_tenants``:
    its state shows tenants unhashed; ``responses_store``: the /v1/responses store's
    FrontendConfig fields), print how to query them, forward signals, shut down
    cleanly."""
    frontend = None
    if openai_port is not None:
        host = url_host(cfg.host)
        try:
            frontend = FrontendProcess(FrontendConfig(
                (f"{host}:{cfg.grpc_port}",), cfg.host, openai_port, served_model_name,
                (f"http://{host}:{cfg.metrics_port}/metrics",), cfg.api_key, *chat_format,
                console_show_tenants=console_show_tenants, **(responses_store or {})))
        except ValueError as e:
            raise ServeError(str(e).replace("--port", "--openai-port")) from None
    server = TritonServer(cfg)
    stop_requested = []

    def on_signal(signum: int, _frame: object) -> None:
        stop_requested.append(signum)

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    def on_usr1(_signum: int, _frame: object) -> None:
        if not cfg.engine_args.get("trace_steps"):
            print("[kvflow serve] SIGUSR1: no step timeline (start with --trace-steps FILE)",
                  file=sys.stderr, flush=True)
        elif server.write_trace() == 0:
            print("[kvflow serve] SIGUSR1: the model is still loading; send it again once "
                  "it is ready", file=sys.stderr, flush=True)

    signal.signal(signal.SIGUSR1, on_usr1)  # writes the step timeline now
    print(f"[kvflow serve] starting tritonserver for {cfg.engine_dir} ...", flush=True)
    server.start()
    if frontend is not None:
        try:
            frontend.start()
        except RuntimeError as e:
            # The engine may have failed while the frontend started (it then stops
            # tritonserver, and the frontend never sees it ready): that is the failure to
            # report, with the engine failure's exit code.
            failure = server.engine_failure()
            server.stop()
            if failure is not None:
                print(f"[kvflow serve] the engine failed: {failure}", file=sys.stderr,
                      flush=True)
                return 1
            raise ServeError(str(e)) from None
    host = url_host(cfg.host)
    key_header = f' -H "{API_KEY_HEADER}: $KVFLOW_API_KEY"' if cfg.api_key else ""
    key_flag = " --api-key $KVFLOW_API_KEY" if cfg.api_key else ""
    # NOTE: this interpreter's own script (.venv/bin/kvflow), so that the printed command works
    # from a shell where the venv is not activated.
    script = Path(sys.executable).parent / "kvflow"
    kvflow = str(script) if script.is_file() else "kvflow"
    print(f"""[kvflow serve] ready: model '{MODEL_NAME}'
  HTTP    http://{cfg.host}:{cfg.http_port}   gRPC {cfg.host}:{cfg.grpc_port}   \
metrics http://{cfg.host}:{cfg.metrics_port}/metrics
  authentication: {"x-api-key header required" if cfg.api_key else "none"}

  curl -N -X POST http://{host}:{cfg.http_port}/v2/models/{MODEL_NAME}/generate_stream\\
      {key_header} -d '{{"text_input": "The capital of France is", "stream": true}}'

  {kvflow} generate --url {host}:{cfg.grpc_port}{key_flag} --chat \\
       --prompt "Tell me about paged attention"
""", flush=True)
    if frontend is not None:
        bearer = ' -H "Authorization: Bearer $KVFLOW_API_KEY"' if cfg.api_key else ""
        print(f"""  OpenAI API http://{cfg.host}:{openai_port}/v1  (chat/completions, completions, \
models)
  curl http://{host}:{openai_port}/v1/chat/completions -H "Content-Type: application/json"\
{bearer} \\
      -d '{{"messages": [{{"role": "user", "content": "Hello!"}}], "max_tokens": 64}}'

  Console    http://{host}:{openai_port}/  (the engine live, and a chat{
    "; any user name, the API key as password" if cfg.api_key else ""})
""", flush=True)
    for warning in exposure_warnings(cfg):
        print(f"[kvflow serve] WARNING: {warning}", file=sys.stderr, flush=True)
    if cfg.api_key and any(cfg.api_key in arg for arg in sys.argv[1:]):
        print("[kvflow serve] WARNING: --api-key on this command line is readable by every "
              f"local user (ps); pass it in {envs.API_KEY} instead.", file=sys.stderr,
              flush=True)
    failure = None
    try:
        while not stop_requested and server.alive:
            time.sleep(0.5)
    finally:
        failure = server.engine_failure()
        print("[kvflow serve] shutting down ...", flush=True)
        if frontend is not None:
            frontend.stop()
        code = server.stop()
    if failure is not None:  # the backend stopped tritonserver: exit 1 for a supervisor
        print(f"[kvflow serve] the engine failed: {failure}", file=sys.stderr, flush=True)
        return 1
    # tritonserver never exits by itself while serving: if it did, that is a failure.
    return 0 if stop_requested else (code or 1)
