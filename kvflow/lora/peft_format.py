"""A PEFT LoRA folder (``adapter_config.json`` + ``adapter_model.safetensors``) read into
:class:`~kvflow.lora.adapter.ModuleLora` entries, without torch.

What PEFT's ``LoraLayer`` computes and this reproduces: ``W x + B (A x) * scaling`` with
``scaling = lora_alpha / r`` (``lora_alpha / sqrt(r)`` with ``use_rslora``), where ``r`` and
``lora_alpha`` of one module may come from ``rank_pattern`` / ``alpha_pattern`` (the first key
that matches the module's name as ``(.*\\.)?(key)$``, PEFT's ``get_pattern_key``). The
configurations that compute something else (DoRA, biases, trained embeddings or heads, ...) are
refused by the field's name.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import numpy as np

from kvflow.lora.adapter import LORA_MODULES, LoraAdapterError, ModuleLora, kvflow_module
from kvflow.model.config import ModelConfig
from kvflow.model.weight_names import weight_parts

# HF linears an adapter may target: kvflow's modules and Phi-3's fused ones (split at load).
FUSED_MODULES = ("qkv_proj", "gate_up_proj")
TARGETABLE = LORA_MODULES + FUSED_MODULES
# adapter_config.json fields whose non-empty value changes what the adapter computes.
_REFUSED_FIELDS = {
    "use_dora": "DoRA (weight-decomposed LoRA)",
    "lora_bias": "a trained bias on lora_B",
    "fan_in_fan_out": "transposed (Conv1D) weights",
    "target_parameters": "LoRA on parameters (MoE experts)",
    "trainable_token_indices": "trained embedding rows",
    "layer_replication": "replicated layers",
    "alora_invocation_tokens": "activated LoRA (aLoRA)",
    "use_qalora": "QA-LoRA's pooled inputs",
    "use_bdlora": "block-diagonal LoRA",
}
_LORA_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[A-Za-z0-9_-]+)?\.weight$")
_PREFIX = "base_model.model."
_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "F64": np.float64}


def read_peft_folder(folder: Path, config: ModelConfig
                     ) -> tuple[list[ModuleLora], float, str | None]:
    """The folder's modules (unscaled A, B and their scaling), its ``lora_alpha`` and its
    ``base_model_name_or_path``."""
    cfg_path = folder / "adapter_config.json"
    if not cfg_path.is_file():
        raise LoraAdapterError(f"{folder}: no adapter_config.json (a PEFT LoRA folder has "
                               "adapter_config.json and adapter_model.safetensors)")
    try:
        lcfg = json.loads(cfg_path.read_text())
    except (OSError, ValueError) as e:
        raise LoraAdapterError(f"{cfg_path}: not JSON: {e}") from e
    if not isinstance(lcfg, dict):
        raise LoraAdapterError(f"{cfg_path}: must be a JSON object")
    weights_path = folder / "adapter_model.safetensors"
    if not weights_path.is_file():
        if (folder / "adapter_model.bin").is_file():
            raise LoraAdapterError(
                f"{folder}: adapter_model.bin is a pickle, which kvflow does not load; save the "
                "adapter as adapter_model.safetensors (save_pretrained(safe_serialization=True))")
        raise LoraAdapterError(f"{folder}: no adapter_model.safetensors")
    check_lora_config(lcfg, config, cfg_path)
    tensors = read_safetensors(weights_path)
    modules = lora_modules(tensors, lcfg, config, weights_path.name)
    base = lcfg.get("base_model_name_or_path")
    return modules, float(lcfg["lora_alpha"]), str(base) if base else None


def check_lora_config(lcfg: dict[str, Any], config: ModelConfig, where: Path) -> None:
    """Refuse, by field name, an adapter_config.json whose adapter kvflow cannot apply."""
    peft_type = lcfg.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise LoraAdapterError(f"{where}: peft_type {peft_type!r}: kvflow serves LORA adapters")
    for key, what in _REFUSED_FIELDS.items():
        if lcfg.get(key):
            raise LoraAdapterError(f"{where}: {key} = {lcfg[key]!r}: kvflow does not serve "
                                   f"{what}")
    if lcfg.get("bias", "none") != "none":
        raise LoraAdapterError(f"{where}: bias = {lcfg['bias']!r}: kvflow serves adapters "
                               "with bias 'none' (no trained biases)")
    if lcfg.get("modules_to_save"):
        raise LoraAdapterError(
            f"{where}: modules_to_save = {lcfg['modules_to_save']!r}: kvflow does not serve "
            "fully trained modules beside the LoRA weights")
    r, alpha = lcfg.get("r"), lcfg.get("lora_alpha")
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise LoraAdapterError(f"{where}: r must be an integer >= 1, got {r!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, int | float):
        raise LoraAdapterError(f"{where}: lora_alpha must be a number, got {alpha!r}")
    for key in ("rank_pattern", "alpha_pattern"):
        if not isinstance(lcfg.get(key) or {}, dict):
            raise LoraAdapterError(f"{where}: {key} must be an object (pattern -> value)")
    _check_targets(lcfg.get("target_modules"), config, where)
    _check_layers(lcfg.get("layers_to_transform"), config, where)


def _check_targets(targets: Any, config: ModelConfig, where: Path) -> None:
    """Refuse a target other than the attention and MLP projections (embed_tokens, lm_head)."""
    if targets is None or targets == "all-linear":  # all-linear: PEFT leaves lm_head out
        return
    if isinstance(targets, str):  # a regex PEFT full-matches against each module's name
        try:
            pattern = re.compile(targets)
        except re.error as e:
            raise LoraAdapterError(f"{where}: target_modules {targets!r}: bad regex: {e}") from e
        for other in ("model.embed_tokens", "lm_head"):
            if pattern.fullmatch(other):
                raise LoraAdapterError(
                    f"{where}: target_modules {targets!r} matches {other}: kvflow adapts only "
                    f"{list(LORA_MODULES)}")
        return
    if not isinstance(targets, list | tuple):
        raise LoraAdapterError(f"{where}: target_modules must be a list or a regex string, "
                               f"got {targets!r}")
    bad = [t for t in targets if str(t).rsplit(".", 1)[-1] not in TARGETABLE]
    if bad:
        raise LoraAdapterError(f"{where}: target_modules {bad}: kvflow adapts only "
                               f"{list(LORA_MODULES)} (and Phi-3's {list(FUSED_MODULES)})")


def _check_layers(layers: Any, config: ModelConfig, where: Path) -> None:
    if layers is None:
        return
    listed = [layers] if isinstance(layers, int) else layers
    if not isinstance(listed, list) or not all(isinstance(i, int) for i in listed):
        raise LoraAdapterError(f"{where}: layers_to_transform must be an integer or a list of "
                               f"them, got {layers!r}")
    past = [i for i in listed if not 0 <= i < config.num_hidden_layers]
    if past:
        raise LoraAdapterError(f"{where}: layers_to_transform {past}: the base model has "
                               f"{config.num_hidden_layers} layers")


def pattern_value(patterns: dict[str, Any], module_key: str, default: Any) -> Any:
    """PEFT's ``get_pattern_key``: the value of the first pattern that matches the end of
    ``module_key`` at a dot boundary, else ``default``."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module_key):
            return value
    return default


def lora_modules(tensors: dict[str, np.ndarray], lcfg: dict[str, Any], config: ModelConfig,
                 file: str) -> list[ModuleLora]:
    """Pair each module's lora_A / lora_B, split fused modules, attach the scaling."""
    pairs: dict[str, dict[str, tuple[str, np.ndarray]]] = {}
    for key, value in tensors.items():
        m = _LORA_KEY.match(key)
        if m is None:
            raise LoraAdapterError(f"{file}: tensor {key}: {_what_it_is(key)}")
        module = m["module"].removeprefix(_PREFIX)
        pairs.setdefault(module, {})[m["ab"]] = (key, value)
    out: list[ModuleLora] = []
    for module, ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise LoraAdapterError(f"{file}: {module} has lora_{''.join(ab)} without its "
                                   f"lora_{'B' if 'A' in ab else 'A'}")
        (a_key, a), (b_key, b) = ab["A"], ab["B"]
        source = f"{a_key} / {b_key}"
        r = int(a.shape[0]) if a.ndim == 2 else 0
        want_r = pattern_value(lcfg.get("rank_pattern") or {}, module, lcfg["r"])
        if r != want_r:
            raise LoraAdapterError(f"{file}: {a_key}: rank {r}, but adapter_config.json says "
                                   f"r = {want_r} for {module}")
        alpha = float(pattern_value(lcfg.get("alpha_pattern") or {}, module, lcfg["lora_alpha"]))
        scale = alpha / math.sqrt(r) if lcfg.get("use_rslora") else alpha / r
        out.extend(split_module(module, a, b, scale, source, config, file))
    return out


def split_module(hf_module: str, a: np.ndarray, b: np.ndarray, scale: float, source: str,
                 config: ModelConfig, file: str) -> list[ModuleLora]:
    """One HF module's pair as kvflow's modules: Phi-3's fused ones split by B's rows
    (:func:`kvflow.model.weight_names.weight_parts`), A shared."""
    rows = int(b.shape[0]) if b.ndim == 2 else 0
    try:
        parts = weight_parts(config, f"{hf_module}.weight", rows)
    except ValueError as e:
        raise LoraAdapterError(f"{file}: {source}: B {list(b.shape)} does not fit the base "
                               f"model: {e}") from e
    out = []
    for part in parts:
        found = kvflow_module(part.name)
        if found is None:
            raise LoraAdapterError(
                f"{file}: {source}: module {hf_module} is not one kvflow adapts (target "
                f"modules must be in {list(LORA_MODULES)}; embed_tokens and lm_head are not)")
        part_b = b if part.rows is None else b[part.rows[0]:part.rows[1]]
        out.append(ModuleLora(found[0], found[1], a, part_b, scale, source))
    return out


def _what_it_is(key: str) -> str:
    if "lora_embedding_" in key:
        return "a LoRA on the embeddings, which kvflow does not serve (target_modules " \
               "embed_tokens)"
    if "lora_magnitude_vector" in key:
        return "a DoRA magnitude, which kvflow does not serve (use_dora)"
    if "modules_to_save" in key or key.endswith(("lm_head.weight", "embed_tokens.weight")):
        return "a fully trained module, which kvflow does not serve (modules_to_save)"
    if key.endswith(".bias"):
        return "a trained bias, which kvflow does not serve (bias must be 'none')"
    return "not a lora_A / lora_B weight"


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors file in fp32 (bf16 and f16 exactly)."""
    try:
        with open(path, "rb") as fh:
            size = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(size))
            data = fh.read()
    except (OSError, ValueError) as e:
        raise LoraAdapterError(f"{path}: not a safetensors file: {e}") from e
    if not isinstance(header, dict):
        raise LoraAdapterError(f"{path}: not a safetensors file: its header is not a JSON object")
    out = {}
    for key, info in header.items():
        if key == "__metadata__":
            continue
        if not isinstance(info, dict) or info.get("dtype") not in _DTYPES:
            dtype = info.get("dtype") if isinstance(info, dict) else info
            raise LoraAdapterError(f"{path.name}: tensor {key} is {dtype!r}; kvflow reads "
                                   f"{sorted(_DTYPES)}")
        try:
            begin, end = info["data_offsets"]
            values = np.frombuffer(data[begin:end], dtype=_DTYPES[info["dtype"]])
            if info["dtype"] == "BF16":  # bf16 is fp32's upper half: exact
                values = (values.astype(np.uint32) << 16).view(np.float32)
            out[key] = values.astype(np.float32).reshape(info["shape"])
        except (KeyError, TypeError, ValueError) as e:  # offsets or shape that do not fit
            raise LoraAdapterError(f"{path.name}: tensor {key}: bad data_offsets or shape "
                                   f"({e})") from None
    return out
