"""A checkpoint read one tensor at a time: a memory-mapped GGUF, or safetensors shards.

:class:`CheckpointTensors` gives the model's config, its tensors' kvflow names
(:mod:`kvflow.model.weight_names`: HF's, with Phi-3's fused linears split and Gemma's norms
``1 + w``; a GGUF's names mapped by :mod:`kvflow.model.gguf_config`) and shapes, and each
tensor on request: fp32 (whole, or a range of rows), or, for a GGUF's Q4_0 / Q4_1 / Q8_0 2-D
weights, its blocks undecoded (:class:`~kvflow.model.quant.QuantizedWeight`). Nothing is read
before it is asked for, and nothing is kept: the build streams a checkpoint larger than memory
through it. Values are bit for bit those of :func:`kvflow.model.loader.load_checkpoint`, which
is this class read whole.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from kvflow.model.config import ModelConfig, UnsupportedModelError
from kvflow.model.gguf_config import PERMUTED_ARCHITECTURES, gguf_config, kvflow_parts
from kvflow.model.quant import GGUF_BLOCK, GGUF_SCHEMES, QuantizedWeight, from_gguf_blocks
from kvflow.model.weight_names import WeightPart, weight_parts

SaveTokenizer = Callable[[Path], None]


class CheckpointTensors:
    """A checkpoint's config and tensors, kvflow-named, each read when asked for.

    Attributes:
        config: the model's shape.
        source: the file or folder it reads.
        save_tokenizer: writes the tokenizer (HF form) into a folder.
    """

    config: ModelConfig
    source: str
    save_tokenizer: SaveTokenizer

    def names(self) -> list[str]:
        """Every tensor's kvflow name, in the checkpoint's order."""
        raise NotImplementedError

    def shape(self, name: str) -> tuple[int, ...]:
        """A tensor's shape (``[out, in]`` for a linear weight)."""
        raise NotImplementedError

    def fp32(self, name: str) -> np.ndarray:
        """The whole tensor in fp32 (a GGUF block type dequantized as gguf-py does)."""
        raise NotImplementedError

    def fp32_rows(self, name: str, start: int, stop: int) -> np.ndarray:
        """Rows ``start:stop`` of a 2-D tensor in fp32, equal to ``fp32(name)[start:stop]``."""
        return self.fp32(name)[start:stop]

    def gguf_scheme(self, name: str) -> str | None:
        """The GGUF block type a 2-D weight is kept in (Q4_0, Q4_1, Q8_0), else None."""
        return None

    def quantized(self, name: str) -> QuantizedWeight | None:
        """The GGUF blocks of ``name`` undecoded (:meth:`gguf_scheme` not None), else None."""
        return None

    def quantized_columns(self, name: str, start: int, stop: int) -> QuantizedWeight:
        """Columns ``start:stop`` (whole blocks) of :meth:`quantized`'s weight."""
        w = self.quantized(name)
        if w is None:
            raise ValueError(f"{name} is not held in GGUF blocks")
        return column_slice(w, start, stop)

    def release(self, name: str) -> None:
        """Done with ``name``: a memory-mapped source drops its pages from this process (they
        stay in the page cache), so that resident memory does not grow to the whole file."""


def column_slice(w: QuantizedWeight, start: int, stop: int) -> QuantizedWeight:
    """Columns ``start:stop`` of ``w``, both multiples of its block size."""
    b0, b1 = start // w.block_size, stop // w.block_size

    def blocks(a: np.ndarray | None) -> np.ndarray | None:
        return None if a is None else a[:, b0:b1]

    return QuantizedWeight(w.scheme, w.bits, w.block_size, w.q[:, start:stop],
                           w.scale[:, b0:b1], blocks(w.zero_point), blocks(w.minimum))


# --- safetensors ----------------------------------------------------------------------------
_SAFETENSORS_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}


def _release_pages(mapped: Any, offset: int, length: int) -> None:
    """Drop ``length`` bytes at ``offset`` of an ``np.memmap`` from this process (MADV_DONTNEED:
    a read-only file mapping's pages stay in the page cache)."""
    import mmap

    handle = getattr(mapped, "_mmap", None)
    if handle is None or not hasattr(mmap, "MADV_DONTNEED") or length <= 0:
        return
    start = offset // mmap.PAGESIZE * mmap.PAGESIZE
    end = min(len(handle), offset + length)
    handle.madvise(mmap.MADV_DONTNEED, start, end - start)


class SafetensorsTensors(CheckpointTensors):
    """A HF folder's ``*.safetensors`` shards, memory-mapped: a tensor, or a range of its rows,
    is converted to fp32 when asked for (bf16 and f16 exactly, as ``Tensor.float()``), and its
    pages are released when the build is done with it."""

    def __init__(self, folder: Path, config: ModelConfig, save_tokenizer: SaveTokenizer) -> None:
        self.config, self.source, self.save_tokenizer = config, str(folder), save_tokenizer
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"--model {folder}: no *.safetensors weights in the folder")
        self._maps: dict[str, np.memmap] = {}
        self._entries: dict[str, tuple[str, str, tuple[int, ...], int, int]] = {}
        for f in files:
            with open(f, "rb") as fh:
                size = int.from_bytes(fh.read(8), "little")
                header = json.loads(fh.read(size))
            self._maps[str(f)] = np.memmap(f, dtype=np.uint8, mode="r")
            for key, info in header.items():
                if key == "__metadata__":
                    continue
                if info["dtype"] not in _SAFETENSORS_DTYPES:
                    raise UnsupportedModelError(
                        f"{f.name}: tensor {key} is {info['dtype']}; kvflow reads "
                        f"{sorted(_SAFETENSORS_DTYPES)}")
                begin, end = info["data_offsets"]
                self._entries[key] = (str(f), info["dtype"], tuple(info["shape"]),
                                      8 + size + begin, end - begin)
        # kvflow name -> the HF tensor it is made from, and how (kvflow/model/weight_names.py)
        self._parts: dict[str, tuple[str, WeightPart]] = {}
        for key, entry in self._entries.items():
            rows = entry[2][0] if entry[2] else 0
            for part in weight_parts(config, key, rows):
                self._parts[part.name] = (key, part)

    def names(self) -> list[str]:
        return list(self._parts)

    def shape(self, name: str) -> tuple[int, ...]:
        key, part = self._parts[name]
        shape = self._entries[key][2]
        return shape if part.rows is None else (part.rows[1] - part.rows[0], *shape[1:])

    def _read_rows(self, key: str, start: int, stop: int) -> np.ndarray:
        file, dtype, shape, offset, _ = self._entries[key]
        kind = np.dtype(_SAFETENSORS_DTYPES[dtype])
        row = int(np.prod(shape[1:], dtype=np.int64)) * kind.itemsize
        raw = self._maps[file][offset + start * row:offset + stop * row]
        values = raw.view(kind).reshape(stop - start, *shape[1:])
        if dtype == "BF16":  # bf16 is fp32's upper half: exact
            return (values.astype(np.uint32) << 16).view(np.float32)
        return values.astype(np.float32)  # a copy, also for F32: the map is read-only

    def fp32_rows(self, name: str, start: int, stop: int) -> np.ndarray:
        key, part = self._parts[name]
        first = 0 if part.rows is None else part.rows[0]
        values = self._read_rows(key, first + start, first + stop)
        return values + np.float32(1) if part.plus_one else values

    def fp32(self, name: str) -> np.ndarray:
        shape = self.shape(name)
        if not shape:
            key, part = self._parts[name]
            file, dtype, _, offset, length = self._entries[key]
            kind = np.dtype(_SAFETENSORS_DTYPES[dtype])
            one = self._maps[file][offset:offset + length].view(kind).reshape(())
            value = ((one.astype(np.uint32) << 16).view(np.float32) if dtype == "BF16"
                     else one.astype(np.float32))
            return value + np.float32(1) if part.plus_one else value
        rows = self.fp32_rows(name, 0, shape[0])
        return rows.reshape(shape)

    def release(self, name: str) -> None:
        file, _, _, offset, length = self._entries[self._parts[name][0]]
        _release_pages(self._maps[file], offset, length)


# --- GGUF -----------------------------------------------------------------------------------
def unpermute_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (interleaved RoPE) to get HF's half-split layout."""
    rows = w.shape[0]
    return (w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


class GGUFTensors(CheckpointTensors):
    """A GGUF file through gguf-py's ``GGUFReader`` (a memory map), kvflow-named: a tensor's
    bytes (or the rows of a fused tensor that one kvflow tensor is) are read from the page
    cache when asked for, decoded, and dropped."""

    def __init__(self, path: Path, save_tokenizer: SaveTokenizer) -> None:
        from gguf import GGUFReader

        self.reader = GGUFReader(str(path))
        self.config, arch = gguf_config(self.reader, path)
        self.source, self.save_tokenizer = str(path), save_tokenizer
        self._permute = arch in PERMUTED_ARCHITECTURES
        names = {t.name for t in self.reader.tensors}
        # kvflow name -> (the file's tensor, the rows it is, or None for all of them)
        self._tensors: dict[str, tuple[Any, tuple[int, int] | None]] = {}
        for t in self.reader.tensors:
            rows = int(t.shape[-1]) if len(t.shape) > 1 else int(t.shape[0])
            for part in kvflow_parts(arch, self.config, t.name, rows, names):
                self._tensors[part.name] = (t, part.rows)

    def names(self) -> list[str]:
        return list(self._tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        t, rows = self._tensors[name]
        shape = tuple(int(d) for d in reversed(t.shape))
        return shape if rows is None else (rows[1] - rows[0], *shape[1:])

    def _data(self, name: str) -> np.ndarray:
        """The file's rows (raw: blocks or values) behind ``name``."""
        t, rows = self._tensors[name]
        return t.data if rows is None else t.data[rows[0]:rows[1]]

    def _heads(self, name: str) -> int | None:
        """Heads of a Q or K weight whose rows llama.cpp permuted, else None."""
        if not self._permute:
            return None
        if ".self_attn.q_proj." in name:
            return self.config.num_attention_heads
        if ".self_attn.k_proj." in name:
            return self.config.num_key_value_heads
        return None

    def _decode(self, name: str, data: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        from gguf.quants import dequantize

        w = np.asarray(dequantize(data, self._tensors[name][0].tensor_type), dtype=np.float32)
        return w.reshape(shape) if w.ndim > 1 or len(shape) > 1 else w

    def fp32(self, name: str) -> np.ndarray:
        w = self._decode(name, self._data(name), self.shape(name))
        heads = self._heads(name)
        if heads is not None:
            w = unpermute_rope(w, heads)
        return np.array(w, dtype=np.float32, order="C")

    def fp32_rows(self, name: str, start: int, stop: int) -> np.ndarray:
        if self._heads(name) is not None:  # the permutation spans heads: decode it whole
            return self.fp32(name)[start:stop]
        rows = self._decode(name, self._data(name)[start:stop],
                            (stop - start, *self.shape(name)[1:]))
        return np.array(rows, dtype=np.float32, order="C")

    def gguf_scheme(self, name: str) -> str | None:
        scheme = self._tensors[name][0].tensor_type.name
        return scheme if scheme in GGUF_SCHEMES and len(self.shape(name)) == 2 else None

    def quantized(self, name: str) -> QuantizedWeight | None:
        if self.gguf_scheme(name) is None:
            return None
        return self.quantized_columns(name, 0, self.shape(name)[1])

    def quantized_columns(self, name: str, start: int, stop: int) -> QuantizedWeight:
        scheme = self.gguf_scheme(name)
        if scheme is None:
            raise ValueError(f"{name} is not held in GGUF blocks")
        out, cols = self.shape(name)
        data = self._data(name)
        if (start, stop) != (0, cols):  # whole blocks of every row: a strided read of the map
            nb = cols // GGUF_BLOCK
            data = data.reshape(out, nb, -1)[:, start // GGUF_BLOCK:stop // GGUF_BLOCK]
        data = np.ascontiguousarray(data).reshape(out, -1)
        q = from_gguf_blocks(scheme, data, out, stop - start)
        heads = self._heads(name)
        if heads is not None:
            q = q.rows(unpermute_rope(np.arange(out)[:, None], heads)[:, 0])
        return q

    def release(self, name: str) -> None:
        t = self._tensors[name][0]
        _release_pages(self.reader.data, int(t.data_offset), int(t.n_bytes))


# --- opening --------------------------------------------------------------------------------
def hf_folder_config(folder: Path) -> ModelConfig:
    """A HF folder's config.json, with generation_config.json's EOS ids (HF's ``generate`` stops
    on those)."""
    gen_path = folder / "generation_config.json"
    generation = json.loads(gen_path.read_text()) if gen_path.is_file() else None
    return ModelConfig.from_hf_config(json.loads((folder / "config.json").read_text()),
                                      generation)
