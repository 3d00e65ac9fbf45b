"""Engine weights for the ONNX Runtime runner: mapped from the engine's files, never copied.

The runner reads ``model.onnx`` without its external data
(``onnx.load(path, load_external_data=False)``). The load-time fusions
(:mod:`kvflow.runtime.ort_graph`) change the graph's structure and read the weights they
transform through :class:`WeightSource`, an ``np.memmap`` of ``model.onnx.data`` at each
tensor's recorded offset and length. The weights they *make* (Q/K/V and gate/up
concatenations, ``kvflow::MatMulQ``'s packed blocks, Q4_1's reshaped minima) are computed one
tensor at a time into a prepared-weights file (:class:`PreparedWeights`): each tensor at an
offset aligned to :data:`ALIGN`, written once, and reused by every later load while the
engine's data file and the fusion options are the same (the file's name is their hash). It lives
in the engine folder, or in the user cache dir (:func:`kvflow.envs.cache_dir`) when the engine
folder is read-only. :func:`prepare` makes it at the end of the build.

How the weights reach ORT (measured with ORT 1.32, /proc/self/status, a 128 MB fp32 MatMul
weight; see the runner's log line for an engine's figures):

- ``SessionOptions.add_external_initializers`` with an OrtValue over an ``np.memmap``: ORT
  *copies* the tensor into its own memory at session creation (RssAnon +128 MB per session,
  with or without graph optimizations and prepacking). Not zero-copy.
- ``SessionOptions.add_initializer``: refused by 1.32 for any graph initializer ("references an
  ORT in-memory address marker").
- The graph's initializers left as external data (``location``/``offset``/``length``) and the
  session created from bytes with ``session.model_external_initializers_file_folder_path`` set
  to the folder: ORT memory-maps each tensor from the file itself. RssAnon unchanged; the pages
  are file-backed, read on first use, and shared with the page cache and with every other
  session of the file. This is what the runner does (:func:`external_folder_config`).
  NOTE: VmRSS counts a file page once per mapping, so two sessions that both run the same weights
  show them twice in VmRSS though memory holds them once (Pss, /proc/self/smaps_rollup, shows the
  truth). ORT refuses external paths that leave that folder (symlinks included), so a prepared
  file in the cache dir is handed over with ``add_external_initializers`` (copied, as above).
- Prepacking (MLAS packs a constant fp32 ``MatMul``/``Gemm`` weight into its own layout and drops
  the original) turns a mapped weight into a private copy per session: the runner disables it
  (``session.disable_prepacking``) for graphs whose fp32 weights are mapped. Folding
  ``DequantizeLinear`` into fp32 weights (``quantized_matmul=fp32``) and ``MatMulNBits``
  (int8 without the native library) make new tensors by design; ``kvflow::MatMulQ`` and
  ``kvflow::GatherQ`` read the mapped blocks in place.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import mmap
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

from kvflow import envs

ALIGN = 4096
FORMAT_VERSION = 1
PREPARED_SUFFIX = ".kvw"
# A tensor a fusion makes that is smaller than this stays in the graph (shapes, split sizes).
INLINE_MAX_BYTES = 64 << 10
FOLDER_CONFIG = "session.model_external_initializers_file_folder_path"
_FOUR_BIT = (TensorProto.UINT4, TensorProto.INT4)

ProgressFn = Callable[[str], None]


def external_info(tensor: TensorProto) -> dict[str, str]:
    """The ``location``/``offset``/``length`` entries of an initializer stored externally."""
    return {e.key: e.value for e in tensor.external_data}


def is_external(tensor: TensorProto) -> bool:
    return tensor.data_location == TensorProto.EXTERNAL


_PLAIN_DTYPES = tuple(np.dtype(t) for t in (np.float32, np.float16, np.uint8, np.int8, np.int32,
                                             np.int64))


class WeightSource:
    """Reads the initializers of a graph loaded without its external data through
    ``np.memmap``: a tensor's array is a view of the mapped file (4-bit codes are unpacked,
    which copies that one tensor)."""

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        self._files: dict[str, np.memmap] = {}

    def _file(self, location: str) -> np.memmap:
        if location not in self._files:
            path = self.folder / location
            if not path.is_file():
                raise FileNotFoundError(f"{path}: the external data file the graph names is "
                                        "missing")
            self._files[location] = np.memmap(path, dtype=np.uint8, mode="r")
        return self._files[location]

    def raw(self, tensor: TensorProto) -> np.ndarray:
        """The tensor's bytes, a view of the mapped file."""
        info = external_info(tensor)
        data = self._file(info["location"])
        offset = int(info.get("offset", 0))
        length = int(info.get("length", data.size - offset))
        if offset + length > data.size:
            raise ValueError(f"initializer {tensor.name!r}: offset {offset} + length {length} "
                             f"is past the end of {info['location']} ({data.size} bytes)")
        return data[offset:offset + length]

    def array(self, tensor: TensorProto) -> np.ndarray:
        """The tensor's value, as ``numpy_helper.to_array`` would give it."""
        raw = self.raw(tensor)
        if tensor.data_type in _FOUR_BIT:
            loaded = TensorProto()
            loaded.CopyFrom(tensor)
            del loaded.external_data[:]
            loaded.data_location = TensorProto.DEFAULT
            loaded.raw_data = raw.tobytes()
            return numpy_helper.to_array(loaded)
        dtype = onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type)
        return raw.view(dtype).reshape(tuple(tensor.dims))

    def release(self) -> None:
        """Drop this process's resident pages of the mapped files (they stay in the page
        cache): a tensor read to make another does not stay counted in the RSS."""
        for data in self._files.values():
            with contextlib.suppress(AttributeError, OSError, ValueError):
                data._mmap.madvise(mmap.MADV_DONTNEED)  # type: ignore[attr-defined]

    def files(self) -> list[Path]:
        """Every data file the graph's initializers name (read so far or not)."""
        return [self.folder / name for name in self._files]

    def close(self) -> None:
        self._files.clear()


def data_identity(paths: list[Path]) -> list[list[int | str]]:
    """What says a data file is unchanged: name, size, mtime (ns) and inode."""
    out: list[list[int | str]] = []
    for p in sorted(paths):
        st = p.stat()
        out.append([p.name, st.st_size, st.st_mtime_ns, st.st_ino])
    return out


def graph_data_files(model: onnx.ModelProto, folder: Path) -> list[Path]:
    names = {external_info(t)["location"] for t in model.graph.initializer if is_external(t)}
    return [Path(folder) / n for n in sorted(names)]


@dataclass
class _Entry:
    offset: int
    length: int
    dims: list[int]
    data_type: int


class PreparedWeights:
    """The tensors the fusions make, in one aligned file keyed by the engine's data file
    identity and the fusion options (see the module doc). ``lookup`` finds a tensor made by an
    earlier load; ``write`` makes the file when some are missing."""

    def __init__(self, engine_dir: Path, data_files: list[Path], options: dict,
                 graph_file: Path | None = None) -> None:
        self.engine_dir = Path(engine_dir)
        self.data_files = list(data_files)
        self.options = json.loads(json.dumps(options, sort_keys=True))
        identity = data_identity([*data_files, *([graph_file] if graph_file else [])])
        key_source = json.dumps({"format": FORMAT_VERSION, "data": identity,
                                 "options": options}, sort_keys=True)
        self.key = hashlib.sha256(key_source.encode()).hexdigest()[:20]
        name = f"prepared-{self.key}{PREPARED_SUFFIX}"
        here = self.engine_dir / name
        if here.is_file() or os.access(self.engine_dir, os.W_OK):
            self.path = here
        else:
            self.path = envs.cache_dir() / "prepared_weights" / name
        self.entries = self._read_index()
        self.written = False  # whether this load wrote the file

    @property
    def in_engine_dir(self) -> bool:
        return self.path.parent == self.engine_dir

    @property
    def index_path(self) -> Path:
        return self.path.with_name(self.path.name + ".json")

    def _read_index(self) -> dict[str, _Entry]:
        try:
            index = json.loads(self.index_path.read_text())
            size = self.path.stat().st_size
        except (OSError, ValueError):
            return {}
        if index.get("size") != size:
            return {}  # a file left half-written, or replaced under us
        return {name: _Entry(**e) for name, e in index["tensors"].items()}

    def lookup(self, name: str, dims: list[int], data_type: int) -> TensorProto | None:
        """The prepared tensor ``name`` as an external-data reference, if the file has it with
        these dims and type."""
        e = self.entries.get(name)
        if e is None or e.dims != list(dims) or e.data_type != data_type:
            return None
        return self._reference(name, e)

    def _reference(self, name: str, e: _Entry) -> TensorProto:
        t = TensorProto(name=name, data_type=e.data_type, dims=e.dims)
        t.data_location = TensorProto.EXTERNAL
        location = self.path.name if self.in_engine_dir else str(self.path.resolve())
        for k, v in (("location", location), ("offset", str(e.offset)),
                     ("length", str(e.length))):
            item = t.external_data.add()
            item.key, item.value = k, v
        return t

    def write(self, tensors: list[tuple[str, Callable[[], np.ndarray]]],
              progress: ProgressFn | None = None,
              release: Callable[[], None] | None = None) -> dict[str, TensorProto]:
        """Compute each tensor (one at a time) into a new file, aligned, and return them as
        external-data references. Replaces the file atomically (index last). ``release``
        runs after each tensor (the source's :meth:`WeightSource.release`)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f"{self.path.name}.tmp-{os.getpid()}")
        entries: dict[str, _Entry] = {}
        offset = 0
        with open(tmp, "wb") as f:
            for i, (name, make) in enumerate(tensors):
                array = np.ascontiguousarray(make())
                offset = -(-offset // ALIGN) * ALIGN
                f.seek(offset)
                if array.dtype in _PLAIN_DTYPES:  # the bytes as they are: no second copy
                    f.write(array.data)
                    entry = _Entry(offset, array.nbytes, list(array.shape),
                                   onnx.helper.np_dtype_to_tensor_dtype(array.dtype))
                else:  # what numpy_helper packs (4-bit types)
                    proto = numpy_helper.from_array(array, name)
                    f.write(proto.raw_data)
                    entry = _Entry(offset, len(proto.raw_data), list(proto.dims),
                                   proto.data_type)
                    del proto
                entries[name] = entry
                offset += entry.length
                del array
                if release is not None:
                    release()
                if progress is not None and (i + 1) % 16 == 0:
                    progress(f"prepared weights: {i + 1}/{len(tensors)} tensors, "
                             f"{offset / 1e6:.0f} MB")
            f.truncate(offset)
        os.replace(tmp, self.path)
        index = {"size": self.path.stat().st_size, "options": self.options,
                 "tensors": {n: vars(e) for n, e in entries.items()}}
        tmp_index = self.index_path.with_name(self.index_path.name + f".tmp-{os.getpid()}")
        tmp_index.write_text(json.dumps(index))
        os.replace(tmp_index, self.index_path)
        self.entries = entries
        self.written = True
        self._remove_stale()
        return {n: self._reference(n, e) for n, e in entries.items()}


    def _remove_stale(self) -> None:
        """Delete the files this one replaces: same folder and options, older data. (A
        process still running on one keeps its mapping.)"""
        for index_path in self.path.parent.glob(f"prepared-*{PREPARED_SUFFIX}.json"):
            other = index_path.with_name(index_path.name.removesuffix(".json"))
            if other == self.path:
                continue
            try:
                options = json.loads(index_path.read_text()).get("options")
            except (OSError, ValueError):
                continue
            if options == self.options:
                index_path.unlink(missing_ok=True)
                other.unlink(missing_ok=True)


def resident_bytes(paths: list[Path]) -> tuple[int, int]:
    """(bytes of ``paths``'s mappings in this process, bytes of them resident), from
    /proc/self/smaps; (0, 0) where it cannot be read."""
    wanted = {str(Path(p).resolve()) for p in paths}
    mapped = resident = 0
    current = False
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                head = line.split()
                if not head:
                    continue
                if "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
                    current = len(head) >= 6 and head[5] in wanted
                elif current and head[0] == "Size:":
                    mapped += int(head[1]) * 1024
                elif current and head[0] == "Rss:":
                    resident += int(head[1]) * 1024
    except OSError:
        return 0, 0
    return mapped, resident


@dataclass
class MappedWeights:
    """How a session of a graph read without its weights gets them: ORT maps the external data
    under ``folder`` itself; tensors stored elsewhere (a prepared file in the cache dir) are
    ``values``, OrtValues over ``np.memmap``s made once and given to every session (ORT
    copies those, see the module doc)."""

    folder: Path
    values: dict[str, object]

    @classmethod
    def for_model(cls, model: onnx.ModelProto, folder: Path) -> MappedWeights:
        import onnxruntime as ort

        source = WeightSource(Path("/"))
        values: dict[str, object] = {}
        for t in model.graph.initializer:
            if not is_external(t) or not Path(external_info(t)["location"]).is_absolute():
                continue
            if t.data_type in _FOUR_BIT:
                # No OrtValue of a 4-bit type can be made over packed bytes from Python:
                # the tensor goes into the graph itself (ORT copies it, as it would anyway).
                data = source.raw(t).tobytes()
                del t.external_data[:]
                t.data_location = TensorProto.DEFAULT
                t.raw_data = data
            else:
                values[t.name] = ort.OrtValue.ortvalue_from_numpy(source.array(t))
        return cls(Path(folder).resolve(), values)  # ORT reads it after any chdir

    def apply(self, opts, model: onnx.ModelProto) -> None:
        """Point ``opts`` (an ``ort.SessionOptions``) at these weights, for ``model``."""
        try:
            opts.get_session_config_entry(FOLDER_CONFIG)
        except Exception:  # noqa: BLE001  (ORT raises a plain error for a missing key)
            opts.add_session_config_entry(FOLDER_CONFIG, str(self.folder))
        names = [t.name for t in model.graph.initializer if t.name in self.values]
        if names:
            opts.add_external_initializers(names, [self.values[n] for n in names])
