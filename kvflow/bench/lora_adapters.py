"""Adapters for the LoRA benchmarks: the base model's HF weights as a folder (PEFT needs one),
and random nonzero PEFT adapters made on it with :func:`kvflow.lora.synthetic.make_peft_adapter`,
kept between runs when they were made with the same settings."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path

MARKER = "kvflow_bench_adapter.json"  # the settings an adapter folder was made with


def hf_folder(model: str, out_dir: str | Path) -> Path:
    """An HF checkpoint folder of ``model``: the folder itself when it is one; for a GGUF (the
    default model), the weights transformers dequantizes from it (its own code, independent of
    kvflow's loader: :func:`kvflow.model.hf_reference.load_hf_reference`), saved once under
    ``out_dir`` and reused."""
    from kvflow.model.loader import resolve_model

    path = resolve_model(model)
    if path.is_dir():
        return path
    target = Path(out_dir) / f"hf-{path.stem}"
    if (target / "config.json").is_file():
        return target
    import torch
    from transformers import AutoModelForCausalLM

    from kvflow.model.hf_reference import load_hf_reference

    # NOTE: transformers marks a model loaded from a GGUF as quantized and refuses to save it,
    # though its weights are dequantized fp32: the same weights, in a plain model, are saved.
    loaded = load_hf_reference(model)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(loaded.state_dict())
    plain.save_pretrained(str(target), safe_serialization=True)
    return target


def adapter_names(count: int) -> list[str]:
    """The benchmark's adapter names: ``lora-0`` .. ``lora-{count-1}``."""
    if count < 1:
        raise ValueError(f"--adapters must be at least 1, got {count}")
    return [f"lora-{i}" for i in range(count)]


def prepare_adapters(hf_dir: str | Path, out_dir: str | Path, count: int, *, rank: int,
                     alpha: float, seed: int, targets: Sequence[str] | None = None,
                     log: Callable[[str], None] = print) -> dict[str, Path]:
    """``count`` PEFT adapters on ``hf_dir`` (name -> folder under ``out_dir``), adapter ``i``
    seeded ``seed + i``, each of rank ``rank`` on ``targets`` (default: all seven projections);
    a folder already made with the same settings is kept."""
    from kvflow.lora import LORA_MODULES

    modules = list(targets or LORA_MODULES)
    out: dict[str, Path] = {}
    for i, name in enumerate(adapter_names(count)):
        folder = Path(out_dir) / name
        settings = {"base": str(Path(hf_dir).resolve()), "rank": rank, "alpha": alpha,
                    "seed": seed + i, "targets": modules}
        marker = folder / MARKER
        if not (marker.is_file() and json.loads(marker.read_text()) == settings
                and (folder / "adapter_config.json").is_file()):
            from kvflow.lora.synthetic import make_peft_adapter

            log(f"[bench lora] making adapter {name}: rank {rank}, alpha {alpha:g}, "
                f"{len(modules)} modules")
            make_peft_adapter(hf_dir, folder, rank=rank, alpha=alpha, targets=modules,
                              seed=seed + i)
            marker.write_text(json.dumps(settings, indent=1) + "\n")
        out[name] = folder
    return out


def adapter_bytes(folder: str | Path) -> int:
    """Bytes of an adapter's weights file(s) on disk."""
    return sum(f.stat().st_size for f in Path(folder).glob("adapter_model.*"))
