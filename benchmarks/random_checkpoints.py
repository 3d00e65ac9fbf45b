"""Random-weight Llama checkpoints of the shapes people run, written locally (no downloads).

One pass over the model's tensors writes, from the same random values:

* an F16 GGUF laid out as llama.cpp's ``convert_hf_to_gguf.py`` writes a Llama model (its tensor
  names, its Q/K row permutation, its metadata keys, 1-D norms in F32), with the SmolLM2
  tokenizer of kvflow's default model (``gpt2`` BPE, its merges and chat template), its token
  list padded to the model's vocabulary with ``[PAD<i>]`` tokens of type UNUSED, as the converter
  pads a vocabulary larger than the tokenizer's;
* a HF folder: ``config.json``, the same tokenizer in HF form (``tokenizer.json`` ...) and bf16
  safetensors shards of at most ``shard_bytes`` each, with ``model.safetensors.index.json``.

Each tensor is generated and written in row chunks (at most :data:`CHUNK_BYTES` of fp32 at a
time): the model never exists whole in memory. Weights are ``normal * 0.02``, norms 1, so that
activations and logits stay finite. RoPE is plain (``rope_theta``, no Llama-3 frequency
scaling, no ``rope_freqs`` tensor), which both kvflow and llama.cpp then run identically.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

CHUNK_BYTES = 64 << 20  # fp32 bytes generated at once
WEIGHT_STD = 0.02
PAD_TOKEN_TYPE = 5  # gguf.TokenType.UNUSED
TOKENIZER_KEYS = ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.merges",
                  "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
                  "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.padding_token_id",
                  "tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_space_prefix",
                  "tokenizer.chat_template")


@dataclass(frozen=True)
class ModelShape:
    """A Llama-family architecture: what config.json and the GGUF metadata say."""

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    tied: bool
    rope_theta: float = 500000.0
    context: int = 131072
    rms_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def tensors(self) -> list[tuple[str, tuple[int, ...]]]:
        """(HF name, shape) of every tensor, in the order they are written."""
        h, kv = self.hidden, self.kv_heads * self.head_dim
        out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (self.vocab, h))]
        for i in range(self.layers):
            p = f"model.layers.{i}."
            out += [(p + "input_layernorm.weight", (h,)),
                    (p + "self_attn.q_proj.weight", (h, h)),
                    (p + "self_attn.k_proj.weight", (kv, h)),
                    (p + "self_attn.v_proj.weight", (kv, h)),
                    (p + "self_attn.o_proj.weight", (h, h)),
                    (p + "post_attention_layernorm.weight", (h,)),
                    (p + "mlp.gate_proj.weight", (self.ffn, h)),
                    (p + "mlp.up_proj.weight", (self.ffn, h)),
                    (p + "mlp.down_proj.weight", (h, self.ffn))]
        out.append(("model.norm.weight", (h,)))
        if not self.tied:
            out.append(("lm_head.weight", (self.vocab, h)))
        return out

    def num_params(self) -> int:
        return sum(int(np.prod(s)) for _, s in self.tensors())

    def hf_config(self, bos: int, eos: int) -> dict:
        """config.json of the HF folder."""
        return {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                "hidden_size": self.hidden, "intermediate_size": self.ffn,
                "num_hidden_layers": self.layers, "num_attention_heads": self.heads,
                "num_key_value_heads": self.kv_heads, "head_dim": self.head_dim,
                "vocab_size": self.vocab, "tie_word_embeddings": self.tied,
                "rms_norm_eps": self.rms_eps, "rope_theta": self.rope_theta,
                "max_position_embeddings": self.context, "hidden_act": "silu",
                "attention_bias": False, "mlp_bias": False, "torch_dtype": "bfloat16",
                "bos_token_id": bos, "eos_token_id": eos}


SHAPES = {
    "1b": ModelShape("Llama-3.2-1B-shape", 2048, 16, 32, 8, 8192, 128256, tied=True),
    "3b": ModelShape("Llama-3.2-3B-shape", 3072, 28, 24, 8, 8192, 128256, tied=True),
    "8b": ModelShape("Llama-3.1-8B-shape", 4096, 32, 32, 8, 14336, 128256, tied=False),
    # every stage in a minute or two: SmolLM2's vocabulary, padded by 128 tokens
    "smoke": ModelShape("tiny-smoke-shape", 256, 2, 4, 2, 512, 49280, tied=True,
                        rope_theta=10000.0, context=4096),
}

_GGUF_LAYER = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q",
               "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
               "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def gguf_name(hf_name: str) -> str:
    """llama.cpp's name of a HF Llama tensor."""
    fixed = {"model.embed_tokens.weight": "token_embd.weight",
             "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}
    if hf_name in fixed:
        return fixed[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, suffix = rest.rsplit(".", 1)
    return f"blk.{layer}.{_GGUF_LAYER[module]}.{suffix}"


def _permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """convert_hf_to_gguf's Q/K row permutation (HF half-split RoPE -> interleaved)."""
    rows = w.shape[0]
    return (w.reshape(n_heads, 2, rows // n_heads // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def _chunks(shape: ModelShape, index: int, name: str, dims: tuple[int, ...],
            seed: int) -> Iterator[np.ndarray]:
    """The fp32 values of one tensor, in row chunks (Q/K whole: their permutation spans heads)."""
    if len(dims) == 1:
        yield np.ones(dims, dtype=np.float32)
        return
    rng = np.random.default_rng([seed, index])
    rows, cols = dims
    whole = name.endswith(("q_proj.weight", "k_proj.weight"))
    step = rows if whole else max(1, CHUNK_BYTES // (4 * cols))
    for start in range(0, rows, step):
        n = min(step, rows - start)
        chunk = rng.standard_normal((n, cols), dtype=np.float32)
        chunk *= WEIGHT_STD
        yield chunk


def to_bf16(x: np.ndarray) -> np.ndarray:
    """fp32 -> bf16 bit patterns (uint16), rounded to nearest even."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


# --- tokenizer ------------------------------------------------------------------------------------
def tokenizer_fields(source: Path) -> dict:
    """The tokenizer metadata of the GGUF ``source`` (kvflow's default model): key -> value."""
    from gguf import GGUFReader

    reader = GGUFReader(str(source))
    out = {}
    for key in (*TOKENIZER_KEYS, "tokenizer.ggml.tokens", "tokenizer.ggml.token_type"):
        field = reader.fields.get(key)
        if field is not None:
            out[key] = field.contents()
    return out


def write_hf_tokenizer(source: Path, out: Path) -> None:
    """``source``'s tokenizer in HF form (tokenizer.json, tokenizer_config.json ...) in ``out``."""
    from transformers import AutoTokenizer

    out.mkdir(parents=True, exist_ok=True)
    AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name).save_pretrained(
        str(out))


# --- writers --------------------------------------------------------------------------------------
class _GGUFSink:
    """An F16 GGUF written tensor by tensor (header, metadata and tensor infos first)."""

    def __init__(self, shape: ModelShape, path: Path, tok: dict) -> None:
        from gguf import GGMLQuantizationType, GGUFWriter, LlamaFileType

        self.shape = shape
        w = GGUFWriter(str(path), "llama")
        w.add_type("model")
        w.add_name(shape.name)
        w.add_block_count(shape.layers)
        w.add_context_length(shape.context)
        w.add_embedding_length(shape.hidden)
        w.add_feed_forward_length(shape.ffn)
        w.add_head_count(shape.heads)
        w.add_head_count_kv(shape.kv_heads)
        w.add_rope_freq_base(shape.rope_theta)
        w.add_layer_norm_rms_eps(shape.rms_eps)
        w.add_file_type(LlamaFileType.MOSTLY_F16)
        w.add_vocab_size(shape.vocab)
        w.add_rope_dimension_count(shape.head_dim)
        w.add_key_length(shape.head_dim)
        w.add_value_length(shape.head_dim)
        tokens = list(tok["tokenizer.ggml.tokens"])
        types = list(tok["tokenizer.ggml.token_type"])
        if len(tokens) > shape.vocab:
            raise ValueError(f"vocab {shape.vocab} is smaller than the tokenizer's {len(tokens)}")
        tokens += [f"[PAD{i}]" for i in range(len(tokens), shape.vocab)]
        types += [PAD_TOKEN_TYPE] * (shape.vocab - len(types))
        w.add_token_list(tokens)
        w.add_token_types(types)
        for key in TOKENIZER_KEYS:
            if key in tok:
                value = tok[key]
                if isinstance(value, bool):
                    w.add_bool(key, value)
                elif isinstance(value, int):
                    w.add_uint32(key, value)
                elif isinstance(value, str):
                    w.add_string(key, value)
                else:
                    w.add_array(key, value)
        w.add_quantization_version(2)
        for name, dims in shape.tensors():
            f16 = len(dims) > 1
            itemsize = 2 if f16 else 4
            w.add_tensor_info(gguf_name(name), dims, np.dtype(np.float16 if f16 else np.float32),
                              int(np.prod(dims)) * itemsize,
                              GGMLQuantizationType.F16 if f16 else GGMLQuantizationType.F32)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        self.writer = w
        assert w.fout is not None
        self.fout = w.fout[0]

    def begin(self) -> None:
        self.writer.write_padding(self.fout, self.fout.tell())

    def write(self, name: str, chunk: np.ndarray) -> None:
        if name.endswith("q_proj.weight"):
            chunk = _permute(chunk, self.shape.heads)
        elif name.endswith("k_proj.weight"):
            chunk = _permute(chunk, self.shape.kv_heads)
        (chunk.astype(np.float16) if chunk.ndim > 1 else chunk).tofile(self.fout)

    def end(self, nbytes: int) -> None:
        self.writer.write_padding(self.fout, nbytes)

    def close(self) -> None:
        self.writer.close()


class _SafetensorsSink:
    """bf16 safetensors shards of at most ``shard_bytes`` (headers known up front)."""

    def __init__(self, shape: ModelShape, folder: Path, shard_bytes: int) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        groups: list[list[tuple[str, tuple[int, ...]]]] = [[]]
        size = 0
        for name, dims in shape.tensors():
            nbytes = int(np.prod(dims)) * 2
            if groups[-1] and size + nbytes > shard_bytes:
                groups.append([])
                size = 0
            groups[-1].append((name, dims))
            size += nbytes
        n = len(groups)
        names = (["model.safetensors"] if n == 1 else
                 [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)])
        self.plan = {name: i for i, group in enumerate(groups) for name, _ in group}
        self.files = []
        weight_map, total = {}, 0
        for fname, group in zip(names, groups, strict=True):
            header: dict = {"__metadata__": {"format": "pt"}}
            offset = 0
            for name, dims in group:
                nbytes = int(np.prod(dims)) * 2
                header[name] = {"dtype": "BF16", "shape": list(dims),
                                "data_offsets": [offset, offset + nbytes]}
                offset += nbytes
                weight_map[name] = fname
            total += offset
            text = json.dumps(header, separators=(",", ":")).encode()
            text += b" " * (-len(text) % 8)
            f = open(folder / fname, "wb")  # noqa: SIM115 (closed in close())
            f.write(struct.pack("<Q", len(text)) + text)
            self.files.append(f)
        if n > 1:
            (folder / "model.safetensors.index.json").write_text(json.dumps(
                {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))

    def write(self, name: str, chunk: np.ndarray) -> None:
        to_bf16(chunk).tofile(self.files[self.plan[name]])

    def close(self) -> None:
        for f in self.files:
            f.close()


def write_checkpoints(shape: ModelShape, tokenizer_gguf: Path, gguf_path: Path | None = None,
                      hf_dir: Path | None = None, seed: int = 0,
                      shard_bytes: int = 5_000_000_000,
                      progress: Callable[[str], None] | None = None) -> None:
    """Write ``shape`` as an F16 GGUF at ``gguf_path`` and/or a bf16 HF folder at ``hf_dir``,
    from the same random values, with ``tokenizer_gguf``'s tokenizer. Each file is written to
    a ``.part`` name and renamed when complete."""
    if gguf_path is None and hf_dir is None:
        raise ValueError("write_checkpoints: give gguf_path or hf_dir (or both)")
    tok = tokenizer_fields(tokenizer_gguf)
    gguf_tmp = gguf_path.with_name(gguf_path.name + ".part") if gguf_path else None
    hf_tmp = hf_dir.with_name(hf_dir.name + ".part") if hf_dir else None
    gsink = _GGUFSink(shape, gguf_tmp, tok) if gguf_tmp else None
    ssink = _SafetensorsSink(shape, hf_tmp, shard_bytes) if hf_tmp else None
    tensors = shape.tensors()
    written = 0
    for index, (name, dims) in enumerate(tensors):
        if gsink:
            gsink.begin()
        for chunk in _chunks(shape, index, name, dims, seed):
            if gsink:
                gsink.write(name, chunk)
            if ssink:
                ssink.write(name, chunk)
        if gsink:
            gsink.end(int(np.prod(dims)) * (2 if len(dims) > 1 else 4))
        written += int(np.prod(dims))
        if progress and (index % 9 == 0 or index == len(tensors) - 1):
            progress(f"[write {shape.name}] tensor {index + 1}/{len(tensors)} {name}, "
                     f"{written / 1e9:.2f}B of {shape.num_params() / 1e9:.2f}B parameters")
    if gsink:
        gsink.close()
        assert gguf_path is not None and gguf_tmp is not None
        gguf_tmp.rename(gguf_path)
    if ssink:
        ssink.close()
        assert hf_dir is not None and hf_tmp is not None
        bos = int(tok.get("tokenizer.ggml.bos_token_id", 1))
        eos = int(tok.get("tokenizer.ggml.eos_token_id", 2))
        (hf_tmp / "config.json").write_text(json.dumps(shape.hf_config(bos, eos), indent=2))
        (hf_tmp / "generation_config.json").write_text(json.dumps(
            {"bos_token_id": bos, "eos_token_id": eos}, indent=2))
        write_hf_tokenizer(tokenizer_gguf, hf_tmp)
        hf_tmp.rename(hf_dir)
