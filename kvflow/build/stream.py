"""The engine's weights written tensor by tensor, straight from the checkpoint.

The graph comes from :func:`kvflow.build.export.export_graph` (and, for quantized engines,
:func:`kvflow.build.quantize.quantize_graph` given :class:`~kvflow.build.quantize.QuantSpec`
s): every weight is a placeholder. :func:`write_weights` fills them in the graph's order, each
one read from the checkpoint (a memory-mapped GGUF, or one safetensors tensor), converted to
the engine's dtype, dequantized or quantized, written to ``model.onnx.data`` at an offset
aligned to :data:`ALIGN` (so that a tensor can be memory-mapped in place), and dropped before
the next. Large fp32 tensors go through in row chunks of at most :data:`CHUNK_BYTES`. So the
build holds at most one weight (and its quantized form) at a time, never the model.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np
import onnx
from onnx import TensorProto

from kvflow.build.export import is_placeholder
from kvflow.build.quantize import QuantSpec, quantized_tensors
from kvflow.model.checkpoint_tensors import CheckpointTensors, column_slice
from kvflow.model.quant import QuantizedWeight, quantize_rtn

ALIGN = 4096
CHUNK_BYTES = 64 << 20  # fp32 rows converted at once
# Smaller tensors stay in the graph file, as onnx.save_model(size_threshold=1024) leaves them.
INLINE_MAX_BYTES = 1024
ProgressFn = Callable[[str], None]
_QUANT_SUFFIXES = (".q", ".scale", ".zero_point", ".minimum")


@dataclass(frozen=True)
class WeightPlan:
    """Where each weight of the graph comes from.

    Attributes:
        dtype: the engine's dtype for fp32 weights (``float32``, ``float16``, ``bfloat16``).
        quantized: graph weight name -> its block form (the GGUF's own, or ``int4``/``int8``).
        rtn_group_size: block size of ``int4``/``int8`` (round to nearest).
        tied: the LM head is the embedding table (``lm_head.weight`` reads
            ``model.embed_tokens.weight``).
        chunk_bytes: fp32 bytes converted at once (rows, or columns of blocks).
    """

    dtype: str
    quantized: dict[str, QuantSpec]
    rtn_group_size: int = 32
    tied: bool = False
    chunk_bytes: int = CHUNK_BYTES

    def source_name(self, name: str) -> str:
        """The checkpoint tensor behind graph weight ``name``."""
        if self.tied and name == "lm_head.weight":
            return "model.embed_tokens.weight"
        return name


class AlignedWriter:
    """One external data file, written front to back, each tensor at a multiple of ALIGN."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file: BinaryIO = open(path, "wb")  # noqa: SIM115 (closed by close())
        self.bytes_written = 0

    def write(self, tensor: TensorProto, chunks: Iterator[bytes | np.ndarray]) -> int:
        """Append ``chunks`` (the tensor's bytes, in order) and point ``tensor`` at them."""
        pad = -self._file.tell() % ALIGN
        if pad:
            self._file.write(b"\0" * pad)
        offset = self._file.tell()
        for chunk in chunks:
            self._file.write(chunk if isinstance(chunk, bytes)
                             else np.ascontiguousarray(chunk).reshape(-1).view(np.uint8).data)
        length = self._file.tell() - offset
        del tensor.external_data[:]
        tensor.ClearField("raw_data")
        tensor.data_location = TensorProto.EXTERNAL
        for key, value in (("location", self.path.name), ("offset", str(offset)),
                           ("length", str(length))):
            tensor.external_data.add(key=key, value=value)
        self.bytes_written += length
        return length

    def close(self) -> None:
        self._file.close()


def cast_array(values: np.ndarray, dtype: str) -> np.ndarray:
    """fp32 ``values`` in the engine's ``dtype``, rounded as ``torch.Tensor.to`` rounds them
    (what the in-memory build did with ``net.to(dtype)``); bfloat16 as ml_dtypes' type."""
    if dtype == "float32":
        return values
    import torch

    t = torch.from_numpy(np.ascontiguousarray(values)).to(getattr(torch, dtype))
    if dtype == "bfloat16":
        import ml_dtypes

        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def _fp32_chunks(source: CheckpointTensors, name: str, dtype: str,
                 chunk_bytes: int = CHUNK_BYTES) -> Iterator[np.ndarray]:
    shape = source.shape(name)
    if len(shape) < 2:
        yield cast_array(source.fp32(name), dtype)
        return
    row_bytes = 4 * int(np.prod(shape[1:]))
    step = max(1, chunk_bytes // row_bytes)
    for start in range(0, shape[0], step):
        yield cast_array(source.fp32_rows(name, start, min(shape[0], start + step)), dtype)


def rtn_weight(source: CheckpointTensors, name: str, scheme: str, group_size: int,
               chunk_bytes: int = CHUNK_BYTES) -> QuantizedWeight:
    """:func:`~kvflow.model.quant.quantize_rtn` of a checkpoint weight, computed by row
    chunks (each row's blocks are its own), so that its fp32 form never exists whole."""
    out, cols = source.shape(name)
    step = max(1, chunk_bytes // (4 * cols))
    parts = [quantize_rtn(source.fp32_rows(name, s, min(out, s + step)), scheme, group_size)
             for s in range(0, out, step)]
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    return QuantizedWeight(
        first.scheme, first.bits, first.block_size, np.concatenate([p.q for p in parts]),
        np.concatenate([p.scale for p in parts]),
        None if first.zero_point is None else np.concatenate([p.zero_point for p in parts]),
        None if first.minimum is None else np.concatenate([p.minimum for p in parts]))


def _quantized_parts(source: CheckpointTensors, plan: WeightPlan,
                     name: str) -> Iterator[QuantizedWeight]:
    """Weight ``name`` quantized, in column chunks of whole blocks (a GGUF's blocks decoded a
    chunk at a time; round to nearest computed whole, by rows, then cut)."""
    spec = plan.quantized[name]
    src = plan.source_name(name)
    out, cols = spec.shape
    # An even number of blocks per chunk: 4-bit tensors pack two values a byte, so the
    # chunks' packed bytes then concatenate to the whole tensor's.
    step = max(1, plan.chunk_bytes // 4 // out // (2 * spec.block_size)) * 2 * spec.block_size
    if spec.scheme in ("int4", "int8"):
        w = rtn_weight(source, src, spec.scheme, plan.rtn_group_size, plan.chunk_bytes)
        for start in range(0, cols, step):
            yield column_slice(w, start, min(cols, start + step))
        return
    if source.gguf_scheme(src) != spec.scheme:
        raise ValueError(f"{src}: the checkpoint no longer holds it as {spec.scheme}")
    for start in range(0, cols, step):
        yield source.quantized_columns(src, start, min(cols, start + step))


def _write_quantized(writer: AlignedWriter, inits: dict[str, TensorProto], name: str,
                     parts: Iterator[QuantizedWeight]) -> list[str]:
    """Write weight ``name``'s blocked initializers (:func:`quantized_tensors`): the codes
    chunk by chunk (rows of the transposed ``[in, out]`` codes are the weight's columns), then
    the per-block tensors (an eighth of the codes or less) whole; returns their names."""
    codes = inits[f"{name}.q"]
    small: list[list[TensorProto]] = []

    def code_chunks() -> Iterator[bytes]:
        for part in parts:
            pieces = quantized_tensors(name, part)
            yield pieces[0].raw_data
            small.append(pieces[1:])

    writer.write(codes, code_chunks())
    written = [codes.name]
    for i, first in enumerate(small[0]):
        # Per-block tensors are [blocks, out]: the chunks' rows, stacked in order.
        raw = b"".join(chunk[i].raw_data for chunk in small)
        target = inits[first.name]
        dims = [sum(int(chunk[i].dims[0]) for chunk in small), int(first.dims[1])]
        if (first.data_type, dims) != (target.data_type, list(target.dims)):
            raise ValueError(f"{first.name}: made {dims}, the graph expects "
                             f"{list(target.dims)}")
        _put(writer, target, raw)
        written.append(first.name)
    return written


def _layer_of(name: str) -> str:
    parts = name.split(".")
    return ".".join(parts[:3]) if name.startswith("model.layers.") else name


def write_weights(graph: onnx.ModelProto, source: CheckpointTensors, plan: WeightPlan,
                  data_path: Path, progress: ProgressFn | None = None) -> int:
    """Fill every placeholder of ``graph`` from ``source`` into ``data_path`` (replaced), and
    move the graph's other large tensors there too; returns the bytes written. Progress: one
    line per layer (and per tensor outside the layers), with the bytes written so far."""
    writer = AlignedWriter(data_path)
    inits = {t.name: t for t in graph.graph.initializer}
    done: set[str] = set()
    layer, layer_start = "", 0

    def report(name: str) -> None:
        nonlocal layer, layer_start
        current = _layer_of(name)
        if (progress is not None and current != layer and layer
                and writer.bytes_written > layer_start):
            progress(f"      wrote {layer}: {(writer.bytes_written - layer_start) / 1e6:.1f} MB "
                     f"({writer.bytes_written / 1e6:.0f} MB in all)")
        if current != layer:
            layer, layer_start = current, writer.bytes_written

    try:
        for tensor in graph.graph.initializer:
            name = tensor.name
            if name in done:
                continue
            base = next((name[:-len(s)] for s in _QUANT_SUFFIXES
                         if name.endswith(s) and name[:-len(s)] in plan.quantized), None)
            if base is not None and is_placeholder(tensor):
                report(base)
                done.update(_write_quantized(writer, inits, base,
                                             _quantized_parts(source, plan, base)))
                source.release(plan.source_name(base))
                continue
            if is_placeholder(tensor):
                report(name)
                src = plan.source_name(name)
                shape = tuple(int(d) for d in tensor.dims)
                if source.shape(src) != shape:
                    raise ValueError(f"{src}: checkpoint shape {list(source.shape(src))} does "
                                     f"not match the graph's {list(shape)}")
                writer.write(tensor, _fp32_chunks(source, src, plan.dtype, plan.chunk_bytes))
                source.release(src)
            elif tensor.data_location != TensorProto.EXTERNAL and tensor.raw_data:
                _put(writer, tensor, tensor.raw_data)
            done.add(name)
        report("")
    finally:
        writer.close()
    left = [t.name for t in graph.graph.initializer if is_placeholder(t)]
    if left:
        raise ValueError(f"no value was written for {left[:5]}")
    return writer.bytes_written


def _put(writer: AlignedWriter, tensor: TensorProto, raw: bytes) -> None:
    """A tensor's bytes: in the graph when small, else in the data file."""
    if len(raw) < INLINE_MAX_BYTES:
        del tensor.external_data[:]
        tensor.data_location = TensorProto.DEFAULT
        tensor.raw_data = raw
    else:
        writer.write(tensor, iter([raw]))


def write_safetensors(source: CheckpointTensors, names: list[str], path: Path,
                      progress: ProgressFn | None = None) -> int:
    """``names`` of ``source`` in fp32 as one safetensors file, header first (every shape is
    known up front), then each tensor in row chunks; returns the bytes of tensor data."""
    import json

    header: dict[str, dict] = {}
    offset = 0
    for name in names:
        shape = source.shape(name)
        nbytes = 4 * int(np.prod(shape, dtype=np.int64))
        header[name] = {"dtype": "F32", "shape": list(shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the format aligns the data to 8 bytes
    with open(path, "wb") as f:
        f.write(len(encoded).to_bytes(8, "little"))
        f.write(encoded)
        for i, name in enumerate(names):
            for chunk in _fp32_chunks(source, name, "float32"):
                f.write(np.ascontiguousarray(chunk).reshape(-1).view(np.uint8).data)
            source.release(name)
            last = i == len(names) - 1
            if progress is not None and (last or _layer_of(names[i + 1]) != _layer_of(name)):
                progress(f"      wrote {_layer_of(name)}: {f.tell() / 1e6:.0f} MB in all")
    return offset
