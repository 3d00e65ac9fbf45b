"""A checkpoint read one tensor at a time: a memory-mapped GGUF, or safetensors shards.

:class:`CheckpointTensors` gives the model's config, its tensors' HF names and shapes, and each
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
from kvflow.model.quant import GGUF_BLOCK, GGUF_SCHEMES, QuantizedWeight, from_gguf_blocks

SaveTokenizer = Callable[[Path], None]


class CheckpointTensors:
    """A checkpoint's config and tensors, HF-named, each read when asked for.

    Attributes:
        config: the model's shape.
        source: the file or folder it reads.
        save_tokenizer: writes the tokenizer (HF form) into a folder.
    """

    config: ModelConfig
    source: str
    save_tokenizer: SaveTokenizer

    def names(self) -> list[str]:
        """Every tensor's HF name, in the checkpoint's order."""
        raise NotImplementedError

    def shape(self, name: str) -> tuple[int, ...]:
        """A tensor's HF shape (``[out, in]`` for a linear weight)."""
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

    def names(self) -> list[str]:
        return list(self._entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entries[name][2]

    def fp32_rows(self, name: str, start: int, stop: int) -> np.ndarray:
        file, dtype, shape, offset, _ = self._entries[name]
        kind = np.dtype(_SAFETENSORS_DTYPES[dtype])
        row = int(np.prod(shape[1:], dtype=np.int64)) * kind.itemsize
        raw = self._maps[file][offset + start * row:offset + stop * row]
        values = raw.view(kind).reshape(stop - start, *shape[1:])
        if dtype == "BF16":  # bf16 is fp32's upper half: exact
            return (values.astype(np.uint32) << 16).view(np.float32)
        return values.astype(np.float32)  # a copy, also for F32: the map is read-only

    def fp32(self, name: str) -> np.ndarray:
        shape = self.shape(name)
        if not shape:
            file, dtype, _, offset, length = self._entries[name]
            kind = np.dtype(_SAFETENSORS_DTYPES[dtype])
            one = self._maps[file][offset:offset + length].view(kind).reshape(())
            return ((one.astype(np.uint32) << 16).view(np.float32) if dtype == "BF16"
                    else one.astype(np.float32))
        rows = self.fp32_rows(name, 0, shape[0])
        return rows.reshape(shape)

    def release(self, name: str) -> None:
        file, _, _, offset, length = self._entries[name]
        _release_pages(self._maps[file], offset, length)


# --- GGUF -----------------------------------------------------------------------------------
_GGUF_ARCHS = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2"}
_GGUF_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}


def unpermute_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (interleaved RoPE) to get HF's half-split layout."""
    rows = w.shape[0]
    return (w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def gguf_field(reader: Any, key: str, default: Any = None) -> Any:
    """A GGUF metadata value, or ``default`` when the key is absent."""
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _hf_name(gguf_name: str) -> str | None:
    fixed = {"token_embd.weight": "model.embed_tokens.weight", "output.weight": "lm_head.weight",
             "output_norm.weight": "model.norm.weight"}
    if gguf_name in fixed:
        return fixed[gguf_name]
    if gguf_name.startswith("blk."):
        _, layer, kind, suffix = gguf_name.split(".", 3)
        if kind in _GGUF_LAYER_NAMES:
            return f"model.layers.{layer}.{_GGUF_LAYER_NAMES[kind]}.{suffix}"
    return None


def gguf_config(reader: Any, path: Path) -> tuple[ModelConfig, str]:
    """The model's config from a GGUF's metadata, and its architecture name."""
    arch = gguf_field(reader, "general.architecture")
    if arch not in _GGUF_ARCHS:
        raise UnsupportedModelError(
            f"--model {path}: unknown architecture {arch!r} (kvflow runs {sorted(_GGUF_ARCHS)})"
        )

    def meta(key: str, default: Any = None) -> Any:
        return gguf_field(reader, f"{arch}.{key}", default)

    heads = int(meta("attention.head_count"))
    hidden = int(meta("embedding_length"))
    names = {t.name for t in reader.tensors}
    vocab = meta("vocab_size") or len(gguf_field(reader, "tokenizer.ggml.tokens"))
    eos = gguf_field(reader, "tokenizer.ggml.eos_token_id")
    hf_config = {
        "architectures": [{"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                           "qwen2": "Qwen2ForCausalLM"}[arch]],
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(meta("feed_forward_length")),
        "num_hidden_layers": int(meta("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta("attention.head_count_kv", heads)),
        "head_dim": int(meta("rope.dimension_count", hidden // heads)),
        "rms_norm_eps": float(meta("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(meta("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(meta("context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": gguf_field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": None if eos is None else int(eos),
    }
    if meta("rope.scaling.type") == "linear":
        hf_config["rope_scaling"] = {"rope_type": "linear",
                                     "factor": float(meta("rope.scaling.factor"))}
    return ModelConfig.from_hf_config(hf_config), arch


class GGUFTensors(CheckpointTensors):
    """A GGUF file through gguf-py's ``GGUFReader`` (a memory map): a tensor's bytes are read
    from the page cache when asked for, decoded, and dropped."""

    def __init__(self, path: Path, save_tokenizer: SaveTokenizer) -> None:
        from gguf import GGUFReader

        self.reader = GGUFReader(str(path))
        self.config, arch = gguf_config(self.reader, path)
        self.source, self.save_tokenizer = str(path), save_tokenizer
        self._permute = arch in ("llama", "mistral")
        self._tensors = {}
        for t in self.reader.tensors:
            key = _hf_name(t.name)
            if key is not None:
                self._tensors[key] = t

    def names(self) -> list[str]:
        return list(self._tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(int(d) for d in reversed(self._tensors[name].shape))

    def _heads(self, name: str) -> int | None:
        """Heads of a Q or K weight whose rows llama.cpp permuted, else None."""
        if not self._permute:
            return None
        if ".self_attn.q_proj." in name:
            return self.config.num_attention_heads
        if ".self_attn.k_proj." in name:
            return self.config.num_key_value_heads
        return None

    def _decode(self, t: Any, data: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        from gguf.quants import dequantize

        w = np.asarray(dequantize(data, t.tensor_type), dtype=np.float32)
        return w.reshape(shape) if w.ndim > 1 or len(shape) > 1 else w

    def fp32(self, name: str) -> np.ndarray:
        t = self._tensors[name]
        w = self._decode(t, t.data, self.shape(name))
        heads = self._heads(name)
        if heads is not None:
            w = unpermute_rope(w, heads)
        return np.array(w, dtype=np.float32, order="C")

    def fp32_rows(self, name: str, start: int, stop: int) -> np.ndarray:
        if self._heads(name) is not None:  # the permutation spans heads: decode it whole
            return self.fp32(name)[start:stop]
        t = self._tensors[name]
        rows = self._decode(t, t.data[start:stop], (stop - start, *self.shape(name)[1:]))
        return np.array(rows, dtype=np.float32, order="C")

    def gguf_scheme(self, name: str) -> str | None:
        scheme = self._tensors[name].tensor_type.name
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
        data = self._tensors[name].data
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
        t = self._tensors[name]
        _release_pages(self.reader.data, int(t.data_offset), int(t.n_bytes))


# --- opening --------------------------------------------------------------------------------
def hf_folder_config(folder: Path) -> ModelConfig:
    """A HF folder's config.json, with generation_config.json's extra EOS ids."""
    config = ModelConfig.from_hf_config(json.loads((folder / "config.json").read_text()))
    gen_path = folder / "generation_config.json"
    if gen_path.is_file():
        eos = json.loads(gen_path.read_text()).get("eos_token_id")
        if eos is not None:
            extra = eos if isinstance(eos, list) else [eos]
            ids = tuple(dict.fromkeys([*config.eos_token_ids, *extra]))
            config = ModelConfig.from_dict({**config.to_dict(), "eos_token_ids": ids})
    return config
