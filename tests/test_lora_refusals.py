"""LoRA adapters kvflow cannot serve are refused with a LoraAdapterError naming the problem:
the field or tensor, and the limit or both shapes (kvflow/lora/)."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("peft")

from kvflow.lora import LoraAdapterError, load_lora_adapter  # noqa: E402
from kvflow.lora.synthetic import make_peft_adapter, write_gguf_lora  # noqa: E402
from kvflow.model.checkpoint_tensors import hf_folder_config  # noqa: E402


@pytest.fixture(scope="module")
def llama(tiny_models):
    """(HF folder, config) of the tiny Llama (8 heads, 2 KV heads, head_dim 8)."""
    base = tiny_models["llama-gqa4"][0]
    return base, hf_folder_config(base)


@pytest.fixture(scope="module")
def good(llama, tmp_path_factory) -> Path:
    """A rank-8 adapter on every projection, to copy and spoil."""
    return make_peft_adapter(llama[0], tmp_path_factory.mktemp("good") / "lora", rank=8)


def edited(good: Path, tmp_path: Path, **changes) -> Path:
    """A copy of ``good`` with ``changes`` made to its adapter_config.json."""
    folder = tmp_path / "edited"
    shutil.copytree(good, folder)
    path = folder / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
    return folder


def refused(path, config, *words, max_rank=16) -> str:
    with pytest.raises(LoraAdapterError) as e:
        load_lora_adapter("bad", path, config, max_rank)
    for w in words:
        assert w in str(e.value), f"{w!r} not in: {e.value}"
    return str(e.value)


def test_rank_over_max_rank_names_both(llama, good):
    refused(good, llama[1], "rank 8", "max_lora_rank 4", max_rank=4)
    assert load_lora_adapter("ok", good, llama[1], 8).rank == 8  # at the limit: fine


@pytest.mark.parametrize("changes, words", [
    ({"use_dora": True}, ["use_dora", "DoRA"]),
    ({"bias": "lora_only"}, ["bias", "lora_only"]),
    ({"bias": "all"}, ["bias", "'none'"]),
    ({"modules_to_save": ["lm_head"]}, ["modules_to_save", "lm_head"]),
    ({"target_modules": ["q_proj", "embed_tokens"]}, ["target_modules", "embed_tokens"]),
    ({"target_modules": ["lm_head"]}, ["target_modules", "lm_head"]),
    ({"target_modules": ".*(lm_head|q_proj)"}, ["target_modules", "lm_head"]),
    ({"target_modules": "model.*(q_proj"}, ["target_modules", "bad regex"]),
    ({"layers_to_transform": [1, 5]}, ["layers_to_transform", "[5]", "2 layers"]),
    ({"peft_type": "IA3"}, ["peft_type", "IA3"]),
    ({"r": 0}, ["r must be an integer >= 1"]),
    ({"r": 4}, ["rank 8", "r = 4"]),
    ({"rank_pattern": {"down_proj": 2}}, ["rank 8", "r = 2", "down_proj"]),
    ({"lora_alpha": "16"}, ["lora_alpha must be a number"]),
    ({"fan_in_fan_out": True}, ["fan_in_fan_out"]),
    ({"alora_invocation_tokens": [5, 6]}, ["alora_invocation_tokens", "aLoRA"]),
    ({"target_parameters": ["mlp.experts.down_proj"]}, ["target_parameters"]),
])
def test_config_fields_are_refused_by_name(llama, good, tmp_path, changes, words):
    refused(edited(good, tmp_path, **changes), llama[1], *words)


def test_peft_made_dora_modules_to_save_and_bias_are_refused(llama, tmp_path):
    """Adapters PEFT itself makes with those options (not only edited configs)."""
    base, cfg = llama
    cases = [({"use_dora": True}, "use_dora"), ({"modules_to_save": ["lm_head"]},
                                                 "modules_to_save"),
             ({"bias": "lora_only"}, "bias")]
    for i, (kwargs, word) in enumerate(cases):
        refused(make_peft_adapter(base, tmp_path / str(i), rank=4, targets=["q_proj"], **kwargs),
                cfg, word)


def test_embedding_and_head_tensors_are_refused_by_name(llama, tmp_path):
    """Tensors on embed_tokens / lm_head are refused even when the config does not say so."""
    base, cfg = llama
    for i, target in enumerate(["embed_tokens", "lm_head"]):
        folder = make_peft_adapter(base, tmp_path / str(i), rank=4, targets=["q_proj", target])
        refused(folder, cfg, target)  # by the config's target_modules
        path = folder / "adapter_config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), "target_modules": None}))
        refused(folder, cfg, target)  # by the tensor itself


def test_shape_that_does_not_fit_names_tensor_and_both_shapes(llama, good):
    wider = dataclasses.replace(llama[1], intermediate_size=128)
    message = refused(good, wider, "gate_proj", "[96, 8]", "[128, 8]", "in 64, out 128")
    assert "lora_B" in message  # the tensor's name
    fewer_kv = dataclasses.replace(llama[1], num_key_value_heads=4)
    refused(good, fewer_kv, "k_proj", "[16, 8]", "[32, 8]")
    shallow = dataclasses.replace(llama[1], num_hidden_layers=1)
    refused(good, shallow, "layer 1", "1 layers")


def test_pickled_weights_and_missing_files_are_refused(llama, good, tmp_path):
    folder = tmp_path / "bin"
    shutil.copytree(good, folder)
    (folder / "adapter_model.safetensors").rename(folder / "adapter_model.bin")
    refused(folder, llama[1], "adapter_model.bin", "pickle")
    (folder / "adapter_model.bin").unlink()
    refused(folder, llama[1], "no adapter_model.safetensors")
    (folder / "adapter_config.json").unlink()
    refused(folder, llama[1], "no adapter_config.json")
    refused(tmp_path / "nowhere", llama[1], "no such file or folder")
    (tmp_path / "junk.txt").write_text("hello")
    refused(tmp_path / "junk.txt", llama[1], "neither a PEFT folder nor a GGUF")


def test_gguf_that_is_not_a_lora_or_for_another_family_is_refused(llama, good, tmp_path,
                                                                   tiny_models):
    base, cfg = llama
    path = write_gguf_lora(good, tmp_path / "lora.gguf", cfg)
    qwen = hf_folder_config(tiny_models["qwen2-bias"][0])
    refused(path, qwen, "general.architecture", "'llama'", "'qwen2'")
    refused(path, cfg, "rank 8", "max_lora_rank 2", max_rank=2)
    refused(path, dataclasses.replace(cfg, intermediate_size=128), "ffn_gate", "[96, 8]",
            "[128, 8]")
    from gguf import GGUFType, GGUFWriter

    model = tmp_path / "model.gguf"
    writer = GGUFWriter(str(model), "llama")
    writer.add_type(GGUFType.MODEL)
    writer.add_tensor("token_embd.weight", np.zeros((4, 64), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    refused(model, cfg, "general.type = 'model'")


def test_gguf_writer_refuses_what_the_format_cannot_carry(llama, good, tmp_path):
    """rslora and per-module patterns: a GGUF LoRA has one alpha / r (the converter drops
    them silently; kvflow's writer refuses them by name)."""
    rs = edited(good, tmp_path, use_rslora=True)
    with pytest.raises(LoraAdapterError, match="use_rslora"):
        write_gguf_lora(rs, tmp_path / "rs.gguf", llama[1])
    # the loaded adapter (scaling folded in) is written fine
    adapter = load_lora_adapter("rs", rs, llama[1], 8)
    back = load_lora_adapter("rs", write_gguf_lora(adapter, tmp_path / "ok.gguf", llama[1]),
                             llama[1], 8)
    assert back.digest == adapter.digest


@pytest.mark.parametrize("header, words", [
    ([], "not a JSON object"),
    ({"w.lora_A.weight": 5}, "tensor w.lora_A.weight is 5"),
    ({"w.lora_A.weight": {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 8]}},
     "bad data_offsets or shape"),
    ({"w.lora_A.weight": {"dtype": "F32", "shape": [2]}}, "bad data_offsets or shape"),
])
def test_a_safetensors_header_of_the_wrong_shape_is_refused_by_name(
        llama, good, tmp_path, header, words):
    folder = tmp_path / "spoilt"
    shutil.copytree(good, folder)
    text = json.dumps(header).encode()
    (folder / "adapter_model.safetensors").write_bytes(
        len(text).to_bytes(8, "little") + text + b"\0" * 8)
    refused(folder, llama[1], "adapter_model.safetensors", words)
