"""kvflow's weight names (kvflow/model/weight_names.py): a Phi-3 state dict split into Llama's
linears runs as HF's Llama with the same numbers; Gemma norms become ``1 + w``; other families
pass through unchanged; torch tensors and numpy arrays alike."""

from __future__ import annotations

import numpy as np
import pytest

from kvflow.model.config import ModelConfig
from kvflow.model.weight_names import to_kvflow_names, weight_parts

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

SHAPE = {"vocab_size": 96, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
         "rms_norm_eps": 1e-5, "tie_word_embeddings": False}


def _random(model):
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.1)
    return model.eval()


def test_phi3_split_runs_as_llama():
    """q/k/v and gate/up rows cut from Phi-3's fused weights: HF's Llama with them gives Phi-3's
    logits (Phi-3 is a Llama with fused linears)."""
    phi = _random(transformers.Phi3ForCausalLM(transformers.Phi3Config(
        **SHAPE, pad_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0)))
    cfg = ModelConfig.from_hf_config({**phi.config.to_dict(),
                                      "architectures": ["Phi3ForCausalLM"]})
    state = dict(to_kvflow_names(cfg, phi.state_dict().items()))
    assert "model.layers.0.self_attn.qkv_proj.weight" not in state
    assert state["model.layers.1.self_attn.k_proj.weight"].shape == (16, 32)
    assert state["model.layers.1.mlp.up_proj.weight"].shape == (48, 32)
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SHAPE)).eval()
    llama.load_state_dict(state, strict=True)
    ids = torch.tensor([[5, 17, 3, 90, 41, 8]])
    with torch.no_grad():
        torch.testing.assert_close(llama(ids).logits, phi(ids).logits, rtol=0, atol=1e-5)


def test_gemma_norms_are_one_plus_w_for_torch_and_numpy():
    gemma = _random(transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
        **SHAPE, head_dim=8, pad_token_id=0)))
    cfg = ModelConfig.from_hf_config({**gemma.config.to_dict(),
                                      "architectures": ["Gemma2ForCausalLM"]})
    hf = gemma.state_dict()
    for items in (hf.items(), ((k, v.numpy()) for k, v in hf.items())):
        got = dict(to_kvflow_names(cfg, items))
        assert set(got) == set(hf)
        for name, value in got.items():
            want = hf[name] + 1 if name.endswith("norm.weight") else hf[name]
            np.testing.assert_array_equal(np.asarray(value), want.numpy(), err_msg=name)
    norms = {n for n in hf if n.endswith("norm.weight")}
    assert "model.layers.1.pre_feedforward_layernorm.weight" in norms
    assert "model.norm.weight" in norms
    # HF's Gemma norm with w equals a plain RMSNorm with 1 + w.
    x = torch.randn(3, 32)
    layer = gemma.model.layers[0].post_feedforward_layernorm
    plain = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + layer.eps)
    kv = dict(to_kvflow_names(cfg, hf.items()))["model.layers.0.post_feedforward_layernorm.weight"]
    with torch.no_grad():
        torch.testing.assert_close(plain * kv, layer(x), rtol=1e-6, atol=1e-6)


def test_other_families_pass_through():
    cfg = ModelConfig("qwen2", 96, 32, 48, 2, 4, 2, 8)
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    items = [("model.norm.weight", a[0]), ("model.layers.0.self_attn.q_proj.weight", a)]
    got = list(to_kvflow_names(cfg, items))
    assert [n for n, _ in got] == [n for n, _ in items]
    assert all(v is w for (_, v), (_, w) in zip(got, items, strict=True))


def test_phi3_fused_rows_must_match_the_config():
    cfg = ModelConfig.from_hf_config({**SHAPE, "architectures": ["Phi3ForCausalLM"]})
    with pytest.raises(ValueError, match="qkv_proj.weight: 40 rows, expected q 32"):
        weight_parts(cfg, "model.layers.0.self_attn.qkv_proj.weight", 40)
    with pytest.raises(ValueError, match="gate_up_proj.weight: 48 rows.*96"):
        weight_parts(cfg, "model.layers.0.mlp.gate_up_proj.weight", 48)


def test_gemma3_multimodal_checkpoint_is_its_text_decoder():
    """transformers 4 and 5 names of Gemma3ForConditionalGeneration's text decoder become
    Gemma3ForCausalLM's (norms 1 + w); the vision tower and projector are dropped."""
    cfg = ModelConfig.from_hf_config({"architectures": ["Gemma3ForConditionalGeneration"],
                                      "text_config": {**SHAPE, "head_dim": 8,
                                                      "model_type": "gemma3_text"}})
    w = np.full((2,), 0.25, np.float32)
    items = [("language_model.model.layers.0.input_layernorm.weight", w),
             ("model.language_model.norm.weight", w),
             ("language_model.lm_head.weight", w),
             ("model.language_model.embed_tokens.weight", w),
             ("vision_tower.vision_model.post_layernorm.weight", w),
             ("model.multi_modal_projector.mm_soft_emb_norm.weight", w)]
    got = dict(to_kvflow_names(cfg, items))
    assert sorted(got) == ["lm_head.weight", "model.embed_tokens.weight",
                           "model.layers.0.input_layernorm.weight", "model.norm.weight"]
    assert got["model.norm.weight"].tolist() == [1.25, 1.25]
    assert got["model.embed_tokens.weight"] is w


def test_gemma_one_plus_w_is_computed_in_fp32():
    """A bf16 (or fp16) norm weight: 1 + w in fp32, as HF's Gemma norm computes it (in bf16,
    1 + 0.0101 would round to 1.0078125)."""
    cfg = ModelConfig.from_hf_config({**SHAPE, "architectures": ["Gemma2ForCausalLM"],
                                      "head_dim": 8})
    w = torch.tensor([0.0101, -0.3], dtype=torch.bfloat16)
    got = dict(to_kvflow_names(cfg, [("model.norm.weight", w)]))["model.norm.weight"]
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, 1.0 + w.float(), rtol=0, atol=0)
    half = np.array([0.0101, -0.3], np.float16)
    got_np = dict(to_kvflow_names(cfg, [("model.norm.weight", half)]))["model.norm.weight"]
    assert got_np.dtype == np.float32
    np.testing.assert_array_equal(got_np, 1 + half.astype(np.float32))
