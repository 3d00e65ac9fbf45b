"""llama.cpp as a peer: a cached CPU build of its tools, an F32 GGUF, ``llama-batched-bench``,
``llama-server``; and what the peer benchmarks share: their ``--engine`` specs and the table
of a comparison's targets.

The source is the llama.cpp that the ``llama-cpp-python`` sdist vendors (``vendor/llama.cpp``),
fetched with pip (a package, no weights) and built once with cmake (Release, CPU only,
``GGML_NATIVE``, no curl, no OpenSSL, no web UI, static libraries) into ``ROOT/build/bin``;
later runs find the binaries there and reuse them. The F32 GGUF is made from the shipped Q4_1
file by ``llama-quantize --allow-requantize ... F32``, so every peer runs the same weights.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tarfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvflow.loadgen.clients import OpenAIClient
from kvflow.utils.procs import ManagedProcess, free_port

SDIST_PACKAGE = "llama-cpp-python"
VENDORED = "vendor/llama.cpp"
REQUIRED_TOOLS = ("llama-batched-bench", "llama-server")
OPTIONAL_TOOLS = ("llama-quantize", "llama-perplexity")
CMAKE_FLAGS = ("-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF",
               "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",
               "-DLLAMA_BUILD_TESTS=OFF", "-DBUILD_SHARED_LIBS=OFF", "-DGGML_CUDA=OFF",
               "-DGGML_METAL=OFF")
# NOTE: this build's repacked Q4_1 CPU buffers crash on load with a segfault (llama_cpp_python
# 0.3.36's llama.cpp), in every tool. Unpacked, ggml runs its own Q4_1 x Q8_1 dot products (int8
# activations still). Every tool runner below passes it; the F32 GGUF is not affected either way.
NO_REPACK = ("--no-repack",)
BENCH_COLUMNS = ("pp", "tg", "batch", "n_kv", "t_pp_s", "s_pp_tok_s", "t_tg_s", "s_tg_tok_s",
                 "t_s", "s_tok_s")


@dataclass(frozen=True)
class LlamaCppBuild:
    """A llama.cpp checkout under ``root``: the source in ``src/``, the build in ``build/``."""

    root: Path
    bin_override: Path | None = None  # a bin folder of llama.cpp tools built elsewhere

    @property
    def src_dir(self) -> Path:
        return self.root / "src"

    @property
    def build_dir(self) -> Path:
        return self.root / "build"

    def tool(self, name: str) -> Path:
        return (self.bin_override or self.build_dir / "bin") / name

    def has(self, name: str) -> bool:
        return self.tool(name).is_file()

    def missing(self, tools: Sequence[str] = REQUIRED_TOOLS) -> list[str]:
        return [t for t in tools if not self.has(t)]

    def version(self) -> str:
        """Which sdist the source came from, and ``llama-server --version``'s first line."""
        sdists = sorted(self.root.glob("llama_cpp_python-*.tar.gz"))
        source = f"vendored by {sdists[-1].name.removesuffix('.tar.gz')}" if sdists else ""
        try:
            out = subprocess.run([str(self.tool("llama-server")), "--version"],
                                 capture_output=True, text=True, timeout=30)
            server = (out.stdout + out.stderr).strip().splitlines()[0]
        except (OSError, subprocess.TimeoutExpired, IndexError):
            server = ""
        return "; ".join(x for x in (source, server) if x)


def _fetch_source(build: LlamaCppBuild, log: Callable[[str], None]) -> None:
    """Unpack the vendored llama.cpp of the llama-cpp-python sdist into ``build.src_dir``
    (downloading the sdist with pip unless one is already in ``build.root``)."""
    build.root.mkdir(parents=True, exist_ok=True)
    sdists = sorted(build.root.glob("llama_cpp_python-*.tar.gz"))
    if not sdists:
        log(f"[llama.cpp] pip download {SDIST_PACKAGE} (sdist) into {build.root}")
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary",
                        ":all:", SDIST_PACKAGE, "-d", str(build.root)], check=True)
        sdists = sorted(build.root.glob("llama_cpp_python-*.tar.gz"))
    sdist = sdists[-1]
    log(f"[llama.cpp] unpacking {VENDORED} from {sdist.name}")
    with tarfile.open(sdist) as tar:
        top = tar.getnames()[0].split("/")[0]
        prefix = f"{top}/{VENDORED}/"
        members = []
        for m in tar.getmembers():
            if m.name.startswith(prefix):
                m.name = m.name[len(prefix):]
                members.append(m)
        tar.extractall(build.src_dir, members=members, filter="data")


def ensure_build(root: str | Path, jobs: int = 2, log: Callable[[str], None] = print,
                 require: Sequence[str] = REQUIRED_TOOLS) -> LlamaCppBuild:
    """The llama.cpp build cached under ``root``, built first if a tool of ``require`` is
    missing (about ten minutes on two cores; progress is printed, the full log is
    ``root/build.log``)."""
    build = LlamaCppBuild(Path(root).resolve())
    if not build.missing(require):
        log(f"[llama.cpp] reusing the cached build in {build.build_dir / 'bin'}")
        return build
    if not (build.src_dir / "CMakeLists.txt").is_file():
        _fetch_source(build, log)
    log(f"[llama.cpp] building {', '.join(build.missing(require))} in {build.build_dir} "
        f"(-j{jobs}; about 10 minutes on 2 cores; log: {build.root / 'build.log'})")
    with open(build.root / "build.log", "a") as out:
        subprocess.run(["cmake", "-S", str(build.src_dir), "-B", str(build.build_dir),
                        *CMAKE_FLAGS], stdout=out, stderr=subprocess.STDOUT, check=True)
        listing = subprocess.run(["cmake", "--build", str(build.build_dir), "--target", "help"],
                                 capture_output=True, text=True, check=True).stdout
        targets = [t for t in dict.fromkeys((*REQUIRED_TOOLS, *OPTIONAL_TOOLS, *require))
                   if re.search(rf"\b{re.escape(t)}\b", listing)]
        proc = subprocess.Popen(["cmake", "--build", str(build.build_dir), f"-j{jobs}",
                                 "--target", *targets], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        assert proc.stdout is not None
        shown = ""
        for line in proc.stdout:
            out.write(line)
            step = re.match(r"\[\s*(\d+)%\]", line)
            if step and step.group(1) != shown:
                shown = step.group(1)
                log(f"[llama.cpp] build {shown}%")
        if proc.wait() != 0:
            raise RuntimeError(f"the llama.cpp build failed (see {build.root / 'build.log'})")
    if build.missing(require):
        raise RuntimeError(f"the llama.cpp build did not produce {build.missing(require)}")
    return build


def ensure_f32_gguf(build: LlamaCppBuild, source: str | Path, out: str | Path,
                    log: Callable[[str], None] = print) -> Path:
    """An F32 GGUF of ``source``'s weights at ``out`` (made once, with llama-quantize)."""
    out = Path(out)
    if out.is_file():
        return out
    if not build.has("llama-quantize"):
        raise RuntimeError(f"{out} is missing and this build has no llama-quantize to make it")
    log(f"[llama.cpp] writing {out} (F32, from {Path(source).name})")
    tmp = out.with_suffix(".part")
    with open(out.parent / "quantize.log", "w") as quant_log:
        subprocess.run([str(build.tool("llama-quantize")), "--allow-requantize", str(source),
                        str(tmp), "F32"], stdout=quant_log, stderr=subprocess.STDOUT, check=True)
    tmp.rename(out)
    return out


@dataclass(frozen=True)
class Target:
    """One figure of a benchmark's targets: kvflow's measure over a peer's (``ratio``), and the
    bound it should meet: ``ratio >= bound``, or ``ratio <= bound`` when ``at_most``."""

    figure: str
    ratio: float
    bound: float
    at_most: bool = False

    @property
    def met(self) -> bool:
        return self.ratio <= self.bound if self.at_most else self.ratio >= self.bound

    def as_dict(self) -> dict[str, Any]:
        return {"figure": self.figure, "ratio": self.ratio, "bound": self.bound,
                "at_most": self.at_most, "met": self.met}


def targets_table(targets: Sequence[Target]) -> list[str]:
    """The markdown table of ``targets``: figure, measured ratio, target, met or not."""
    lines = ["| figure | measured | target | met |", "|---|---|---|---|"]
    for t in targets:
        lines.append(f"| {t.figure} | {t.ratio:.2f} | {'<=' if t.at_most else '>='} "
                     f"{t.bound:g} | {'yes' if t.met else '**no**'} |")
    return lines


def parse_engine_specs(specs: Sequence[str] | None, default: str,
                       ) -> tuple[dict[str, str], dict[str, dict[str, Any]]]:
    """``--engine NAME=DIR[,KEY=VALUE...]`` specs (``default`` when none): each engine's folder
    by name, and the engine options of its own. A bad spec exits naming it."""
    engines: dict[str, str] = {}
    options: dict[str, dict[str, Any]] = {}
    for spec in specs or [default]:
        head, *extra = spec.split(",")
        name, sep, folder = head.partition("=")
        if not sep or not name or not folder:
            raise SystemExit(f"--engine must be NAME=DIR[,KEY=VALUE...], got {spec!r}")
        if name in engines:
            raise SystemExit(f"--engine {spec}: the name {name!r} is given twice")
        if not (Path(folder) / "engine_config.json").is_file():
            raise SystemExit(f"--engine {spec}: {folder} is not an engine folder")
        engines[name] = folder
        options[name] = parse_engine_options(extra, f"--engine {spec}")
    return engines, options


def parse_engine_options(specs: Sequence[str] | None, where: str) -> dict[str, Any]:
    """``KEY=VALUE`` engine options, each parsed by its :class:`EngineOptions` field; an
    unknown key or a bad value exits naming ``where``."""
    from kvflow.orchestrator.options import parse_option

    options = {}
    for spec in specs or []:
        key, sep, value = spec.partition("=")
        if not sep:
            raise SystemExit(f"{where}: {spec!r} is not KEY=VALUE")
        try:
            options[key] = parse_option(key, value)
        except ValueError as e:
            raise SystemExit(f"{where}: {e}") from None
    return options


def _run_tool(cmd: list[str], log_path: Path | None) -> str:
    """Run one llama.cpp tool to its end; its stdout and stderr together (also written, after
    the command line, to ``log_path``). A failure raises with the output's tail."""
    proc = subprocess.run(cmd, capture_output=True, text=True)
    text = proc.stdout + proc.stderr
    if log_path is not None:
        log_path.write_text(" ".join(cmd) + "\n" + text)
    if proc.returncode != 0:
        raise RuntimeError(f"{Path(cmd[0]).name} exited with {proc.returncode}: "
                           f"{text.strip()[-500:]}")
    return text


def parse_batched_bench(text: str) -> list[dict[str, float]]:
    """The rows of ``llama-batched-bench``'s markdown table, keyed by :data:`BENCH_COLUMNS`."""
    rows = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != len(BENCH_COLUMNS):
            continue
        try:
            values = [float(c) for c in cells]
        except ValueError:
            continue  # the header and the rule
        row: dict[str, float] = dict(zip(BENCH_COLUMNS, values, strict=True))
        for key in ("pp", "tg", "batch", "n_kv"):
            row[key] = int(row[key])
        rows.append(row)
    return rows


def batched_bench(build: LlamaCppBuild, model: str | Path, prompt_tokens: int | Sequence[int],
                  output_tokens: int, batches: list[int], threads: int,
                  log_path: Path | None = None) -> list[dict[str, float]]:
    """Run ``llama-batched-bench`` (B independent prompts, no shared prefix) once over all
    ``batches`` and prompt lengths (``prompt_tokens``: one or several); one row per (prompt
    length, batch size). The context holds the largest case whole (the tool silently skips a
    case whose KV does not fit)."""
    lengths = [prompt_tokens] if isinstance(prompt_tokens, int) else list(prompt_tokens)
    ctx = max(batches) * (max(lengths) + output_tokens)
    cmd = [str(build.tool("llama-batched-bench")), "-m", str(model), "-c", str(ctx),
           "-npp", ",".join(map(str, lengths)), "-ntg", str(output_tokens),
           "-npl", ",".join(map(str, batches)), "-t", str(threads), "-tb", str(threads),
           *NO_REPACK]
    rows = parse_batched_bench(_run_tool(cmd, log_path))
    got = sorted((r["pp"], r["batch"]) for r in rows)
    want = sorted((pp, b) for pp in lengths for b in batches)
    if got != want:
        raise RuntimeError(f"llama-batched-bench reported (prompt, batch) {got}, asked for "
                           f"{want}")
    return rows


class LlamaServer(ManagedProcess):
    """``llama-server`` on loopback, a free port, ``slots`` parallel slots, prompt caching
    off; a context manager that stops its process group whatever happens."""

    def __init__(self, build: LlamaCppBuild, model: str | Path, slots: int, ctx_per_slot: int,
                 threads: int, log_path: Path | None = None,
                 ready_timeout_s: float = 300.0) -> None:
        port = free_port()
        super().__init__(
            "llama-server",
            [str(build.tool("llama-server")), "-m", str(model), "--host", "127.0.0.1",
             "--port", str(port), "-t", str(threads), "-tb", str(threads), "-np", str(slots),
             "-c", str(slots * ctx_per_slot), "--no-cache-prompt", "--cache-reuse", "0",
             "--cache-ram", "0", "--no-webui", *NO_REPACK],
            log_path=log_path or Path(os.devnull), port=port, stop_timeout_s=20.0)
        self.ready_timeout_s = ready_timeout_s

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self) -> None:
        self.wait_for_http(f"{self.url}/health", self.ready_timeout_s, "the model")


class LlamaServerClient(OpenAIClient):
    """:class:`OpenAIClient` for ``llama-server``'s ``/v1/completions``: the same connections,
    request and SSE stream, plus ``cache_prompt: false``. llama-server sends no usage in its
    stream chunks, so each chunk's token counts come from its per-token timings
    (``timings_per_token``: ``predicted_n``, ``prompt_n``). It closes the connection after
    each streamed response, so each request opens a new one (on loopback, well under a ms)."""

    name = "llama-server"

    def request_body(self, prompt: str, max_tokens: int) -> dict[str, Any]:
        return {"model": self.model, "prompt": prompt, "max_tokens": max_tokens,
                "temperature": 0.0, "ignore_eos": True, "stream": True,
                "cache_prompt": False, "timings_per_token": True}

    def token_counts(self, event: dict[str, Any]) -> tuple[int, int] | None:
        timings = event.get("timings")
        return (int(timings["predicted_n"]), int(timings["prompt_n"])) if timings else None

    def after_stream(self, conn: Any) -> None:
        # NOTE: llama-server closes the connection after a streamed response (despite its
        # Keep-Alive header); closed here, the next request opens a new one.
        conn.close()



def parse_perplexity(text: str) -> dict[str, float]:
    """``llama-perplexity``'s figures: ``perplexity`` (its final estimate, or ``Mean PPL(Q)``
    with ``--kl-divergence``), ``chunks``, and with ``--kl-divergence`` ``mean_kl`` and
    ``top1_agreement`` (its "Same top p", as a fraction)."""
    out: dict[str, float] = {}
    for key, pattern in (("perplexity", r"Final estimate: PPL = ([0-9.]+)"),
                         ("perplexity", r"Mean PPL\(Q\)\s*:\s*([0-9.]+)"),
                         ("chunks", r"(?:calculating perplexity|computing) over (\d+) chunks"),
                         ("mean_kl", r"Mean\s+KLD:\s*(-?[0-9.]+)"),
                         ("top1_agreement", r"Same top p:\s*([0-9.]+)")):
        m = re.search(pattern, text)
        if m:
            out[key] = float(m.group(1))
    if "top1_agreement" in out:
        out["top1_agreement"] /= 100.0
    if "perplexity" not in out:
        raise RuntimeError(f"no perplexity in llama-perplexity's output: {text.strip()[-500:]}")
    return out


def llama_perplexity(build: LlamaCppBuild, model: str | Path, text_file: str | Path,
                     context: int, threads: int, kl_base: Path, compare: bool,
                     log_path: Path | None = None) -> dict[str, float]:
    """``llama-perplexity`` on ``model`` over ``text_file`` in chunks of ``context`` tokens
    (each scoring its second half). Without ``compare`` it saves its logits to ``kl_base``; with
    it, it reads them back and reports the KL divergence from them (``--kl-divergence``)."""
    cmd = [str(build.tool("llama-perplexity")), "-m", str(model), "-f", str(text_file),
           "-c", str(context), "-b", str(context), "-t", str(threads), "-tb", str(threads),
           "--kl-divergence-base", str(kl_base), *NO_REPACK]
    if compare:
        cmd.append("--kl-divergence")
    return parse_perplexity(_run_tool(cmd, log_path))
