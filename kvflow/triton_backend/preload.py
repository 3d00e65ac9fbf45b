"""Start tritonserver with its keys off the command line and its shared memory private.

tritonserver reads its restricted-API keys from arguments only, which every local user can read
in ``/proc/<pid>/cmdline``, and the Python backend makes its ``/dev/shm`` regions (request text)
mode 0644 whatever the umask. :func:`popen` starts it with ``preload.c`` (an ``LD_PRELOAD``
library, built here with the machine's C compiler on first use, or by ``make install``): each
argument holding a secret becomes a placeholder on the command line, and the real arguments reach
the process through a pipe, read before ``main()``; and the regions keep the umask (0077).

The library also widens INT32 tensors sent for the inputs named in ``WIDEN_VARIABLE`` (the
model's INT64 inputs, :func:`int64_inputs`) to INT64, so that clients written for TensorRT-LLM
(INT32) and those that send INT64 are both served, and Triton's HTTP JSON parser, which wraps a
value that does not fit a 32-bit input, only ever fills 64-bit ones.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

SOURCE = Path(__file__).with_name("preload.c")
PLACEHOLDER = "@kvflow-secret"  # NOTE: the same in preload.c
FD_VARIABLE = "KVFLOW_SECRET_ARGS_FD"
WIDEN_VARIABLE = "KVFLOW_WIDEN_INPUTS"  # NOTE: the same in preload.c
_INT64_INPUT = re.compile(r'\{\s*name:\s*"(\w+)",\s*data_type:\s*TYPE_INT64\b')
# What tritonserver and its backend stubs create (their /dev/shm regions included) is private.
UMASK = 0o077


class PreloadError(RuntimeError):
    """The library could not be built (no C compiler, or it failed)."""


def _candidate_dirs() -> list[Path]:
    """This Python environment's own folder (what ``make install`` fills), then the user's
    cache (a system-wide install that this user cannot write to)."""
    return [Path(sys.prefix) / "lib" / "kvflow", Path.home() / ".cache" / "kvflow"]


def library_name() -> str:
    """The library's file name: it names the source's hash, so that an edit rebuilds it."""
    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:16]
    return f"libkvflow-preload-{digest}.so"


def library() -> Path:
    """The built library; builds it on first use. Raises PreloadError if it cannot be built."""
    name = library_name()
    for folder in _candidate_dirs():
        if (folder / name).is_file():
            return folder / name
    errors = []
    for folder in _candidate_dirs():
        try:
            return _build(folder, name)
        except (OSError, PreloadError) as e:
            errors.append(f"{folder}: {e}")
    raise PreloadError("; ".join(errors))


def _build(folder: Path, name: str) -> Path:
    compiler = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if compiler is None:
        raise PreloadError("no C compiler (cc, gcc or clang) on PATH")
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    # NOTE: built beside its final name, then renamed: servers starting together never load a
    # half-written file.
    fd, tmp = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=folder)
    os.close(fd)
    try:
        result = subprocess.run([compiler, "-shared", "-fPIC", "-O2", "-Wall", "-o", tmp,
                                 str(SOURCE), "-ldl"], capture_output=True, text=True)
        if result.returncode != 0:
            raise PreloadError(f"{compiler} failed: {result.stderr.strip()[-2000:]}")
        os.chmod(tmp, 0o755)
        os.replace(tmp, folder / name)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return folder / name


def int64_inputs(config: str) -> list[str]:
    """The inputs a ``config.pbtxt`` (its text) declares TYPE_INT64: those the library widens."""
    inputs = config[config.index("input ["):config.index("output [")]
    return _INT64_INPUT.findall(inputs)


def hide_secrets(cmd: list[str], secrets: list[str]) -> tuple[list[str], list[str]]:
    """The command line with each argument that contains a secret replaced by the placeholder,
    and those arguments in order."""
    visible, hidden = [], []
    for arg in cmd:
        if any(s and s in arg for s in secrets):
            if "\n" in arg:
                raise ValueError("a secret argument cannot hold a newline")
            visible.append(PLACEHOLDER)
            hidden.append(arg)
        else:
            visible.append(arg)
    return visible, hidden


def popen(cmd: list[str], secrets: list[str], env: dict[str, str],
          **kwargs: Any) -> subprocess.Popen:
    """``subprocess.Popen(cmd, ...)`` with the arguments that hold ``secrets`` passed through a
    pipe, never on the command line nor in the environment, and with umask 0077 honoured by
    shared memory. Raises PreloadError if the library cannot be built."""
    lib = library()
    visible, hidden = hide_secrets(cmd, secrets)
    env = dict(env)
    env["LD_PRELOAD"] = ":".join(p for p in (str(lib), env.get("LD_PRELOAD", "")) if p)
    read_end, write_end = os.pipe()
    try:
        # NOTE: far below the pipe's buffer (64 KiB): the write cannot block.
        os.write(write_end, "\n".join(hidden).encode())
        os.close(write_end)
        write_end = -1
        env[FD_VARIABLE] = str(read_end)
        return subprocess.Popen(visible, env=env, pass_fds=(read_end,), umask=UMASK, **kwargs)
    finally:
        os.close(read_end)
        if write_end >= 0:
            os.close(write_end)


def main() -> int:
    """``python -m kvflow.triton_backend.preload``: build the library now (``make install``)."""
    try:
        print(library())
    except PreloadError as e:
        print(f"kvflow: the preload library could not be built ({e}); `kvflow serve` will "
              "refuse --api-key until it can be (install a C compiler)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
