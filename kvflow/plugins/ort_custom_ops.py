"""The ONNX Runtime custom-op library: ``kvflow::PagedAttention`` in C++, built on this machine.

``paged_attention_ort.cc`` implements the node of :mod:`kvflow.plugins.torch_op` as an ORT
kernel, so that one session runs a whole engine step (with ``kvflow::MatMulQ``,
``kvflow::GatherQ`` and ``kvflow::LoraMatMul`` beside it). It is compiled here, with the
machine's ``g++``, against ONNX Runtime's C API headers alone (the API table reaches the
library through ``RegisterCustomOps``; nothing links against ``libonnxruntime.so``). Headers
of API 21 load into any newer runtime.

It is compiled once per instruction set (:mod:`kvflow.plugins.ort_isa`: portable, AVX2,
AVX-VNNI, AVX-512 VNNI), each a library of its own, and the one to load is picked at load time
from the CPU's flags (``KVFLOW_ISA`` forces one). ``make install`` builds every variant the
compiler can, so a venv moved to another CPU needs no compiler; :func:`library` builds the one
it needs if it is missing. :func:`native_isa` and :func:`native_gemm` read what the loaded
variant is from the library itself (its exported ``kvflow_ortops_isa`` and
``kvflow_ortops_gemm``, through ctypes).

The headers are not in the onnxruntime wheel. ``make install`` runs ``python -m
kvflow.plugins.ort_custom_ops --fetch-headers``, which downloads Debian 13's
``libonnxruntime-dev`` with a private apt configuration (the system's sources untouched) and
unpacks its headers into ``<venv>/onnxruntime-headers``; a system ``/usr/include/onnxruntime``
serves too.

The built library is cached under a name that holds its ISA and hashes everything it depends
on: the sources, the headers' API file, the flags (the ISA's included) and the compiler's
identity. Any change rebuilds it. No ``-march=native``: what a variant runs on is its flags
alone, so the build machine's CPU is no part of the key.

For the runner: :func:`library` (the path, or None) and :func:`unavailable_reason` (why not).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from kvflow import envs
from kvflow.plugins import ort_isa

SOURCE = Path(__file__).with_name("paged_attention_ort.cc")
# SOURCE and the headers it includes: what the library's name hashes.
SOURCES = (SOURCE, SOURCE.with_name("paged_attention_ort_kernel.h"),
           SOURCE.with_name("paged_attention_ort_simd.h"),
           SOURCE.with_name("paged_attention_ort_scores.h"), SOURCE.with_name("matmul_q_ort.h"),
           SOURCE.with_name("matmul_q_kernel.h"), SOURCE.with_name("matmul_q_gemm.h"),
           SOURCE.with_name("matmul_q_gemm_x86.h"), SOURCE.with_name("gather_q_ort.h"),
           SOURCE.with_name("matmul_q_gemv512.h"), SOURCE.with_name("isa.h"),
           SOURCE.with_name("lora_matmul_ort.h"), SOURCE.with_name("lora_matmul_kernel.h"))
API_HEADER = "onnxruntime_c_api.h"
HEADERS_DIRNAME = "onnxruntime-headers"
# Debian 13 (trixie) ships ONNX Runtime 1.21's headers (API 21) in this package.
HEADERS_PACKAGE = "libonnxruntime-dev"
HEADERS_SUITE = "trixie"
DEBIAN_MIRROR = "http://deb.debian.org/debian"
DEBIAN_KEYRING = Path("/usr/share/keyrings/debian-archive-keyring.gpg")
# -ffast-math minus -ffinite-math-only (the kernel masks with finite values, yet keeps NaN
# semantics honest) and without its link step: GCC 12 links crtfastmath.o into a -shared
# library built with -ffast-math, which turns on flush-to-zero for the whole Python process.
# The ISA's flags (ort_isa.flags) follow these.
CXX_FLAGS = ("-std=c++17", "-O3", "-fno-math-errno", "-fno-trapping-math",
             "-fassociative-math", "-fno-signed-zeros", "-freciprocal-math",
             "-ffp-contract=fast", "-fPIC", "-shared", "-fvisibility=hidden", "-Wall",
             "-Wno-psabi", "-Wfatal-errors")

_resolved: dict[tuple[Path | None, str], tuple[Path | None, str | None]] = {}


class CustomOpsUnavailable(RuntimeError):
    """The library cannot be built or loaded here; the message says why."""


def header_dirs() -> list[Path]:
    """Where the headers are looked for: this environment's own copy (``make install``), then
    a system-wide ``libonnxruntime-dev``."""
    return [Path(sys.prefix) / HEADERS_DIRNAME, Path("/usr/include/onnxruntime")]


def find_headers(headers_dir: Path | None = None) -> Path:
    """The folder holding ``onnxruntime_c_api.h``: ``headers_dir`` if given, else the first of
    :func:`header_dirs`. Raises CustomOpsUnavailable naming the folders searched."""
    folders = [headers_dir] if headers_dir is not None else header_dirs()
    for folder in folders:
        if (folder / API_HEADER).is_file():
            return folder
    raise CustomOpsUnavailable(
        f"no ONNX Runtime C API headers ({API_HEADER} is in none of "
        f"{', '.join(str(f) for f in folders)}); `make install` fetches them "
        f"(python -m kvflow.plugins.ort_custom_ops --fetch-headers)")


def _compiler() -> str:
    for name in ("g++", "c++", "clang++"):
        path = shutil.which(name)
        if path:
            return path
    raise CustomOpsUnavailable("no C++ compiler (g++, c++ or clang++) on PATH")


def compile_flags(isa: str) -> list[str]:
    """Every compiler flag of ``isa``'s variant (the macro KVFLOW_ISA_NAME names it inside)."""
    return [*CXX_FLAGS, *ort_isa.flags(isa), f'-DKVFLOW_ISA_NAME="{isa}"']


def library_name(headers: Path, compiler: str, isa: str) -> str:
    """The file name: the ISA and a hash of the sources, the API header, the flags and the
    compiler's identity (its path and ``--version``)."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    digest = hashlib.sha256()
    for part in (*(source.read_bytes() for source in SOURCES),
                 (headers / API_HEADER).read_bytes(),
                 " ".join(compile_flags(isa)).encode(), compiler.encode(), version.encode()):
        digest.update(hashlib.sha256(part).digest())
    return f"libkvflow-ortops-{isa}-{digest.hexdigest()[:16]}.so"


def _cache_dirs() -> list[Path]:
    """This environment's own folder (what ``make install`` fills), then kvflow's per-machine
    cache (``KVFLOW_CACHE_DIR``; for an environment this user cannot write to)."""
    return [Path(sys.prefix) / "lib" / "kvflow", envs.cache_dir()]


def build(headers_dir: Path | None = None, isa: str = "portable") -> Path:
    """``isa``'s library, built now unless a cached one matches. Raises
    CustomOpsUnavailable."""
    headers = find_headers(headers_dir)
    compiler = _compiler()
    name = library_name(headers, compiler, isa)
    for folder in _cache_dirs():
        if (folder / name).is_file():
            return folder / name
    errors = []
    for folder in _cache_dirs():
        try:
            return _compile(compiler, headers, folder, name, isa)
        except OSError as e:
            errors.append(f"{folder}: {e}")
    raise CustomOpsUnavailable("cannot write the library: " + "; ".join(errors))


def _compile(compiler: str, headers: Path, folder: Path, name: str, isa: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True, mode=0o755)
    # NOTE: built beside its final name, then renamed: processes starting together never load
    # a half-written file.
    fd, tmp = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=folder)
    os.close(fd)
    try:
        result = subprocess.run([compiler, *compile_flags(isa), f"-I{headers}", "-o", tmp,
                                 str(SOURCE)], capture_output=True, text=True)
        if result.returncode != 0:
            lines = result.stderr.strip().splitlines()
            errors = [line for line in lines if "error" in line] or lines
            raise CustomOpsUnavailable(f"{compiler} failed on {SOURCE.name} ({isa}): "
                                       + "\n".join(errors)[:1500])
        os.chmod(tmp, 0o755)
        os.replace(tmp, folder / name)
        # Superseded builds of this ISA, and those named before there were ISAs (a loaded
        # one stays mapped where it is in use).
        for old in folder.glob("libkvflow-ortops-*.so"):
            parts = old.stem.split("-")
            if old.name != name and (len(parts) == 3 or parts[2] == isa):
                old.unlink(missing_ok=True)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return folder / name


def _check_loads(path: Path) -> None:
    import onnxruntime as ort

    try:
        ort.SessionOptions().register_custom_ops_library(str(path))
    except Exception as e:  # ORT raises its own pybind error types
        raise CustomOpsUnavailable(f"onnxruntime {ort.__version__} cannot load {path}: {e}") \
            from e


def _resolve(headers_dir: Path | None, isa: str | None) -> tuple[Path | None, str | None]:
    try:
        chosen = ort_isa.select(isa)
    except ort_isa.IsaUnavailable as e:
        return None, str(e)
    key = (headers_dir, chosen)
    if key not in _resolved:
        try:
            path = build(headers_dir, chosen)
            _check_loads(path)
            _resolved[key] = (path, None)
        except CustomOpsUnavailable as e:
            _resolved[key] = (None, str(e))
    return _resolved[key]


def library(headers_dir: Path | None = None, isa: str | None = None) -> Path | None:
    """The custom-op library for ``SessionOptions.register_custom_ops_library``, built if need
    be (at most once a process), or None when it cannot be: :func:`unavailable_reason` says
    why. ``headers_dir`` replaces the folders searched for the headers; ``isa`` (else
    ``KVFLOW_ISA``, else the best this CPU runs) picks the variant."""
    return _resolve(headers_dir, isa)[0]


def unavailable_reason(headers_dir: Path | None = None, isa: str | None = None) -> str | None:
    """Why :func:`library` is None (an ISA this CPU lacks, headers missing, no compiler, the
    compiler's error, the runtime refusing the library), or None when it is available."""
    return _resolve(headers_dir, isa)[1]


def _exported(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    lib.kvflow_ortops_isa.restype = ctypes.c_char_p
    lib.kvflow_ortops_gemm.restype = ctypes.c_int
    return lib


def native_isa(isa: str | None = None) -> str | None:
    """The ISA the loaded library was compiled for (``portable``, ``avx2``, ``avxvnni``,
    ``avx512vnni``), as the library itself says; None when it is unavailable."""
    path = library(isa=isa)
    return None if path is None else _exported(path).kvflow_ortops_isa().decode()


def native_gemm(isa: str | None = None) -> bool:
    """Whether the loaded library's kvflow::MatMulQ runs large steps (prefill, big batches) on
    its tiled int8 GEMM (every variant but ``portable``); False when it is unavailable."""
    path = library(isa=isa)
    return path is not None and bool(_exported(path).kvflow_ortops_gemm())


def paged_attention_model(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                          num_blocks: int | None, kv_dtype: int = 0,
                          **attrs: int | float) -> bytes:
    """A serialized ONNX model of one ``kvflow::PagedAttention`` node (layer 0) whose inputs
    and output are the graph's, with the attributes the runner sets (``num_blocks`` None leaves
    it out) and any others given (``sliding_window``, ``logit_softcap``, ``parallel_min_work``):
    the library alone, for tests and benchmarks."""
    from onnx import TensorProto, helper

    from kvflow.plugins.torch_op import ONNX_DOMAIN, ONNX_OP_TYPE, ONNX_OP_VERSION

    f, i64, i32 = TensorProto.FLOAT, TensorProto.INT64, TensorProto.INT32
    hd, kvd = num_heads * head_dim, num_kv_heads * head_dim
    shapes: list[tuple[str, int, list[str | int | None]]] = [
        ("q", f, ["T", hd]), ("k", f, ["T", kvd]), ("v", f, ["T", kvd]),
        ("kv_cache_ptrs", i64, ["L", 2]), ("slot_mapping", i64, ["T"]),
        ("block_tables", i32, ["S", "B"]), ("seq_lens", i32, ["S"]),
        ("query_start_loc", i32, ["S1"])]
    inputs = [helper.make_tensor_value_info(name, dtype, shape) for name, dtype, shape in shapes]
    node = helper.make_node(ONNX_OP_TYPE, [i.name for i in inputs], ["out"], domain=ONNX_DOMAIN)
    values: dict[str, int | float] = dict(
        layer_idx=0, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        block_size=block_size, scale=head_dim ** -0.5, kv_dtype=kv_dtype, **attrs)
    if num_blocks is not None:
        values["num_blocks"] = num_blocks
    node.attribute.extend(helper.make_attribute(k, v) for k, v in values.items())
    graph = helper.make_graph([node], "paged_attention", inputs,
                              [helper.make_tensor_value_info("out", f, ["T", hd])])
    model = helper.make_model(graph, opset_imports=[
        helper.make_opsetid("", 17), helper.make_opsetid(ONNX_DOMAIN, ONNX_OP_VERSION)])
    return model.SerializeToString()


def fetch_headers(dest: Path | None = None) -> Path:
    """Download Debian 13's ``libonnxruntime-dev`` with a private apt configuration (the
    system's sources, lists and cache untouched) and put its headers in ``dest`` (default:
    this environment's ``onnxruntime-headers``). Needs apt-get, dpkg-deb and the network.
    Raises CustomOpsUnavailable saying which step failed."""
    dest = dest or Path(sys.prefix) / HEADERS_DIRNAME
    for tool in ("apt-get", "dpkg-deb", "dpkg"):
        if shutil.which(tool) is None:
            raise CustomOpsUnavailable(f"cannot fetch {HEADERS_PACKAGE}: no {tool} (not Debian?)")
    if not DEBIAN_KEYRING.is_file():
        raise CustomOpsUnavailable(f"cannot fetch {HEADERS_PACKAGE}: no Debian archive keyring "
                                   f"at {DEBIAN_KEYRING} (apt-get install debian-archive-keyring)")
    arch = subprocess.run(["dpkg", "--print-architecture"], capture_output=True,
                          text=True).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="kvflow-apt-") as tmp:
        root = Path(tmp)
        for sub in ("lists/partial", "cache/archives/partial", "etc/sources.list.d",
                    "etc/preferences.d", "deb", "x"):
            (root / sub).mkdir(parents=True)
        (root / "etc/sources.list").write_text(
            f"deb [signed-by={DEBIAN_KEYRING}] {DEBIAN_MIRROR} {HEADERS_SUITE} main\n")
        options = [f"-oDir::Etc::SourceList={root}/etc/sources.list",
                   f"-oDir::Etc::SourceParts={root}/etc/sources.list.d",
                   f"-oDir::State::Lists={root}/lists", f"-oDir::Cache={root}/cache",
                   f"-oDir::Etc::Preferences={root}/etc/preferences",
                   f"-oDir::Etc::PreferencesParts={root}/etc/preferences.d",
                   f"-oAPT::Architecture={arch}", "-oDebug::NoLocking=1", "-q"]
        for step, cwd in ((["update"], root), (["download", HEADERS_PACKAGE], root / "deb")):
            result = subprocess.run(["apt-get", *options, *step], cwd=cwd, capture_output=True,
                                    text=True)
            if result.returncode != 0:
                raise CustomOpsUnavailable(f"`apt-get {' '.join(step)}` ({HEADERS_SUITE}) "
                                           f"failed: {result.stderr.strip()[-800:]}")
        debs = sorted((root / "deb").glob("*.deb"))
        if not debs:
            raise CustomOpsUnavailable(f"apt-get download left no {HEADERS_PACKAGE} .deb")
        subprocess.run(["dpkg-deb", "-x", str(debs[0]), str(root / "x")], check=True)
        found = root / "x/usr/include/onnxruntime"
        if not (found / API_HEADER).is_file():
            raise CustomOpsUnavailable(f"{debs[0].name} holds no {API_HEADER}")
        staged = dest.with_name(dest.name + ".partial")
        shutil.rmtree(staged, ignore_errors=True)
        shutil.copytree(found, staged)
        shutil.rmtree(dest, ignore_errors=True)
        staged.rename(dest)
    return dest


def main(argv: list[str] | None = None) -> int:
    """``python -m kvflow.plugins.ort_custom_ops [--fetch-headers]``: build the library now
    (``make install``), fetching the headers first when asked and absent."""
    args = sys.argv[1:] if argv is None else argv
    if "--fetch-headers" in args:
        try:
            find_headers()
        except CustomOpsUnavailable:
            try:
                print(f"kvflow: ONNX Runtime headers in {fetch_headers()}", file=sys.stderr)
            except (CustomOpsUnavailable, OSError, subprocess.CalledProcessError) as e:
                print(f"kvflow: could not fetch the ONNX Runtime headers ({e})", file=sys.stderr)
    # Every variant the compiler builds (a venv moved to another CPU loads its own); one
    # that fails is reported and skipped.
    if ort_isa.is_x86():
        for isa in ort_isa.ISAS:
            try:
                build(None, isa)
            except CustomOpsUnavailable as e:
                print(f"kvflow: no {isa} variant of the native op library: {e}",
                      file=sys.stderr)
    path = library()
    if path is None:
        print(f"kvflow: the ONNX Runtime custom-op library is unavailable "
              f"({unavailable_reason()}); the CPU runner falls back to one ORT session per "
              "layer", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
