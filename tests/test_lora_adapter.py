"""LoRA adapters read by kvflow (kvflow/lora/) equal what HF + PEFT apply.

Adapters are made locally with ``peft`` on tiny random-weight checkpoints (random nonzero A and
B). For every linear of the base, kvflow's ``W + B·A`` (B with the scaling folded in) equals
PEFT's merged weight (``merge_and_unload``) to fp32 rounding, and the linears the adapter leaves
alone are untouched; A and B themselves are PEFT's, bit for bit. The same adapter written as a
GGUF LoRA file (kvflow's writer, and llama.cpp's own convert_lora_to_gguf.py when a checkout is
there) reads back to the same weights and digest.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from kvflow.lora import LORA_MODULES, LoraAdapter, load_lora_adapter  # noqa: E402
from kvflow.lora.adapter import ModuleLora, build_adapter, kvflow_module, module_shape  # noqa: E402
from kvflow.lora.synthetic import make_peft_adapter, write_gguf_lora  # noqa: E402
from kvflow.model.checkpoint_tensors import hf_folder_config  # noqa: E402
from kvflow.model.config import ModelConfig  # noqa: E402
from kvflow.model.weight_names import to_kvflow_names  # noqa: E402

# fp32 rounding of W + delta (|W| < 0.5): a few ulps.
ATOL = 2e-7
LLAMA_CPP = Path(os.environ.get("KVFLOW_LLAMA_CPP_SRC",
                                Path(__file__).parent.parent / "reports/peers/llama.cpp/src"))
# Families beyond tests/conftest.py's TINY_MODELS: Phi-3 (fused qkv_proj / gate_up_proj),
# Gemma 3 and Qwen3 (q/k norms; Gemma's own GGUF names), from tests/test_model_families.py.
OWN_FAMILIES = ("phi3", "gemma3", "qwen3")


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory) -> dict[str, Path]:
    from tests.test_model_families import make_family_model

    root = tmp_path_factory.mktemp("lora-families")
    out = {}
    for name in OWN_FAMILIES:
        make_family_model(name, root / name)
        out[name] = root / name
    return out


def base_dir(tiny_models, family_dirs, name: str) -> Path:
    return family_dirs[name] if name in OWN_FAMILIES else tiny_models[name][0]


def peft_reference(base: Path, adapter: Path, cfg: ModelConfig):
    """(base weights, merged weights, {kvflow (layer, module): (A, B * scaling)}) from HF +
    PEFT, kvflow-named (Phi-3's fused linears split)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    before = dict(to_kvflow_names(cfg, ((k, v.numpy().copy())
                                        for k, v in model.state_dict().items())))
    peft_model = peft.PeftModel.from_pretrained(model, str(adapter))
    pairs = {}
    for name, module in peft_model.named_modules():
        if "default" in getattr(module, "lora_A", {}):
            a = module.lora_A["default"].weight.detach()
            b = (module.lora_B["default"].weight * module.scaling["default"]).detach()
            hf_name = name.removeprefix("base_model.model.") + ".weight"
            for kv_name, value in to_kvflow_names(cfg, [(hf_name, b.numpy())]):
                pairs[kvflow_module(kv_name)] = (a.numpy(), value)
    merged = dict(to_kvflow_names(cfg, ((k, v.numpy()) for k, v in
                                        peft_model.merge_and_unload().state_dict().items())))
    return before, merged, pairs


def assert_matches_peft(adapter: LoraAdapter, base: Path, adapter_dir: Path,
                        cfg: ModelConfig) -> None:
    before, merged, pairs = peft_reference(base, adapter_dir, cfg)
    assert set(adapter.weights) == set(pairs)
    for key, value in merged.items():
        found = kvflow_module(key)
        if found not in adapter.weights:
            np.testing.assert_array_equal(value, before[key], err_msg=key)
            continue
        a, b = adapter.weights[found]
        assert a.dtype == b.dtype == np.float32 and a.shape[0] == b.shape[1] == adapter.rank
        want_a, want_b = pairs[found]
        r = want_a.shape[0]
        np.testing.assert_array_equal(a[:r], want_a, err_msg=key)  # PEFT's, bit for bit
        np.testing.assert_array_equal(b[:, :r], want_b, err_msg=key)
        assert not a[r:].any() and not b[:, r:].any()  # padding to the adapter's rank
        assert not np.array_equal(value, before[key]), key  # the adapter changes it
        np.testing.assert_allclose(before[key] + b @ a, value, rtol=0, atol=ATOL, err_msg=key)


@pytest.mark.parametrize("name", ["llama-gqa4", "qwen2-bias", "mistral", *OWN_FAMILIES])
def test_peft_adapter_is_peft_merge(tiny_models, family_dirs, tmp_path, name):
    """Every projection adapted, alpha / r: W + B·A is PEFT's merged weight."""
    base = base_dir(tiny_models, family_dirs, name)
    cfg = hf_folder_config(base)
    folder = make_peft_adapter(base, tmp_path / "lora", rank=8, alpha=12, seed=1)
    adapter = load_lora_adapter("a", folder, cfg, max_rank=16)
    assert (adapter.name, adapter.path, adapter.rank, adapter.alpha) == ("a", str(folder), 8, 12)
    assert adapter.base_model == str(base)  # recorded from base_model_name_or_path
    assert set(adapter.weights) == {(i, m) for i in range(cfg.num_hidden_layers)
                                    for m in LORA_MODULES}
    assert adapter.nbytes == sum(a.nbytes + b.nbytes for a, b in adapter.weights.values())
    assert_matches_peft(adapter, base, folder, cfg)


def test_rslora_scales_by_alpha_over_sqrt_r(tiny_models, tmp_path):
    base = tiny_models["llama-gqa4"][0]
    cfg = hf_folder_config(base)
    plain = load_lora_adapter("p", make_peft_adapter(base, tmp_path / "p", rank=4, alpha=6),
                              cfg, 8)
    folder = make_peft_adapter(base, tmp_path / "rs", rank=4, alpha=6, use_rslora=True)
    rs = load_lora_adapter("rs", folder, cfg, 8)
    assert_matches_peft(rs, base, folder, cfg)
    a, b = rs.weights[(0, "q_proj")]
    np.testing.assert_array_equal(a, plain.weights[(0, "q_proj")][0])  # same seed
    np.testing.assert_allclose(b, plain.weights[(0, "q_proj")][1] * 2, rtol=1e-6)  # sqrt(4)
    assert rs.digest != plain.digest


def test_patterns_regex_targets_and_layers(tiny_models, tmp_path):
    """rank_pattern / alpha_pattern per module, a regex target_modules, layers_to_transform:
    each module with its own r and alpha, padded to the adapter's largest rank."""
    base = tiny_models["llama-gqa4"][0]
    cfg = hf_folder_config(base)
    regex = make_peft_adapter(base, tmp_path / "regex", rank=6, alpha=8,
                              targets=r"model\.layers\.1\..*(q_proj|down_proj)",
                              rank_pattern={"q_proj": 2}, alpha_pattern={"down_proj": 3})
    adapter = load_lora_adapter("r", regex, cfg, 8)
    assert set(adapter.weights) == {(1, "q_proj"), (1, "down_proj")} and adapter.rank == 6
    assert_matches_peft(adapter, base, regex, cfg)
    layers = make_peft_adapter(base, tmp_path / "layers", rank=4, targets=["v_proj", "up_proj"],
                               layers_to_transform=[1])
    adapter = load_lora_adapter("l", layers, cfg, 8)
    assert set(adapter.weights) == {(1, "v_proj"), (1, "up_proj")}
    assert_matches_peft(adapter, base, layers, cfg)


def test_base_model_name_is_recorded_not_checked(tiny_models, tmp_path):
    """A different base_model_name_or_path loads: the shapes decide whether it fits."""
    import json

    base = tiny_models["llama-gqa4"][0]
    folder = make_peft_adapter(base, tmp_path / "lora", rank=4)
    cfg_path = folder / "adapter_config.json"
    cfg_path.write_text(json.dumps({**json.loads(cfg_path.read_text()),
                                    "base_model_name_or_path": "someone/Other-7B"}))
    adapter = load_lora_adapter("a", folder, hf_folder_config(base), 8)
    assert adapter.base_model == "someone/Other-7B"


def test_digest_is_the_weights(tiny_models, tmp_path):
    base = tiny_models["qwen2-bias"][0]
    cfg = hf_folder_config(base)
    one = make_peft_adapter(base, tmp_path / "one", rank=4, seed=5)
    again = load_lora_adapter("b", one, cfg, 8)
    assert load_lora_adapter("a", one, cfg, 8).digest == again.digest  # not the name
    other = load_lora_adapter("c", make_peft_adapter(base, tmp_path / "two", rank=4, seed=6),
                              cfg, 8)
    assert other.digest != again.digest and len(other.digest) == 64


@pytest.mark.parametrize("name", ["llama-gqa4", "qwen2-bias", *OWN_FAMILIES])
def test_gguf_round_trip_equals_peft_load(tiny_models, family_dirs, tmp_path, name):
    """write_gguf_lora, from the PEFT folder (the converter's layout: B unscaled, Q/K rows
    permuted for Llama, Phi-3 fused) and from the loaded adapter (B scaled, alpha = r), reads
    back to the PEFT load's weights, bit for bit."""
    from gguf import GGUFReader

    base = base_dir(tiny_models, family_dirs, name)
    cfg = hf_folder_config(base)
    folder = make_peft_adapter(base, tmp_path / "lora", rank=4, alpha=8, seed=2)
    want = load_lora_adapter("a", folder, cfg, 8)
    for source in (folder, want):
        path = write_gguf_lora(source, tmp_path / "lora.gguf", cfg)
        reader = GGUFReader(str(path))
        names = {t.name for t in reader.tensors}
        fused = name == "phi3"
        assert ("blk.1.attn_qkv.weight.lora_b" in names) == fused
        assert ("blk.1.attn_q.weight.lora_a" in names) != fused
        got = load_lora_adapter("a", path, cfg, 8)
        assert got.digest == want.digest
        for key, (a, b) in want.weights.items():
            np.testing.assert_array_equal(got.weights[key][0], a)
            np.testing.assert_array_equal(got.weights[key][1], b)
    if name == "llama-gqa4":  # the file's Q rows are permuted: not PEFT's order
        raw = {t.name: np.asarray(t.data) for t in GGUFReader(str(path)).tensors}
        assert not np.array_equal(raw["blk.0.attn_q.weight.lora_b"], want.weights[0, "q_proj"][1])


def test_phi3_parts_with_different_a_fuse_block_diagonally(family_dirs, tmp_path):
    """A kvflow adapter whose Phi-3 q and v have their own A (and no k) is written as one
    fused attn_qkv pair of rank 2r (B block-diagonal, k's rows zero) and reads back to an
    adapter that computes the same: W + B·A equal, k's delta zero."""
    cfg = hf_folder_config(family_dirs["phi3"])
    rng = np.random.default_rng(0)
    (q, hidden), (kv, _) = module_shape(cfg, "q_proj"), module_shape(cfg, "v_proj")

    def rand(*shape):
        return rng.normal(0, 0.1, shape).astype(np.float32)

    modules = [ModuleLora(0, "q_proj", rand(3, hidden), rand(q, 3), 0.5, "q"),
               ModuleLora(0, "v_proj", rand(3, hidden), rand(kv, 3), 0.5, "v")]
    adapter = build_adapter("h", "hand", cfg, 8, modules, 1.5, None)
    got = load_lora_adapter("h", write_gguf_lora(adapter, tmp_path / "h.gguf", cfg), cfg, 8)
    assert got.rank == 6 and set(got.weights) == {(0, "q_proj"), (0, "k_proj"), (0, "v_proj")}
    for module in ("q_proj", "v_proj"):
        a, b = adapter.weights[0, module]
        ga, gb = got.weights[0, module]
        np.testing.assert_allclose(gb @ ga, b @ a, rtol=0, atol=1e-7)
    assert not got.weights[0, "k_proj"][1].any()


@pytest.mark.skipif(not (LLAMA_CPP / "convert_lora_to_gguf.py").is_file(),
                    reason="no llama.cpp checkout (KVFLOW_LLAMA_CPP_SRC)")
@pytest.mark.parametrize("name", ["llama-gqa4", "phi3", "gemma3"])
def test_llama_cpp_converter_output_equals_peft_load(tiny_models, family_dirs, tmp_path, name):
    """llama.cpp's own convert_lora_to_gguf.py on the PEFT folder: the file reads back to the
    PEFT load's weights (its alpha / r scaling applied by kvflow, Q/K rows un-permuted)."""
    base = base_dir(tiny_models, family_dirs, name)
    cfg = hf_folder_config(base)
    folder = make_peft_adapter(base, tmp_path / "lora", rank=4, alpha=6, seed=4)
    out = tmp_path / "real.gguf"
    done = subprocess.run([sys.executable, str(LLAMA_CPP / "convert_lora_to_gguf.py"),
                           "--base", str(base), "--outtype", "f32", "--outfile", str(out),
                           str(folder)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    want = load_lora_adapter("a", folder, cfg, 8)
    got = load_lora_adapter("a", out, cfg, 8)
    assert got.alpha == 6 and got.base_model
    assert set(got.weights) == set(want.weights)
    for key, (a, b) in want.weights.items():
        np.testing.assert_array_equal(got.weights[key][0], a)
        np.testing.assert_array_equal(got.weights[key][1], b)


@pytest.mark.slow
def test_default_model_adapter(tmp_path):
    """An adapter made with PEFT on the default model's HF weights: loaded with the config
    kvflow reads from the GGUF it serves, it is PEFT's merge; llama.cpp's converter output of
    it (9 heads, 3 KV heads: Q/K rows permuted) reads back the same."""
    from gguf import GGUFReader

    from kvflow.bench.lora_adapters import hf_folder
    from kvflow.model.gguf_config import gguf_config
    from kvflow.model.loader import default_model_path

    try:
        gguf_path = default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    base = hf_folder("default", tmp_path)
    cfg = gguf_config(GGUFReader(str(gguf_path)), gguf_path)[0]
    folder = make_peft_adapter(base, tmp_path / "lora", rank=16, alpha=32, seed=7)
    adapter = load_lora_adapter("d", folder, cfg, max_rank=16)
    assert len(adapter.weights) == 7 * cfg.num_hidden_layers
    assert_matches_peft(adapter, base, folder, cfg)
    if not (LLAMA_CPP / "convert_lora_to_gguf.py").is_file():
        return
    out = tmp_path / "real.gguf"
    done = subprocess.run([sys.executable, str(LLAMA_CPP / "convert_lora_to_gguf.py"),
                           "--base", str(base), "--outfile", str(out), str(folder)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert load_lora_adapter("d", out, cfg, 16).digest == adapter.digest


def test_lora_package_imports_no_torch():
    """kvflow.lora (reading, checking, writing GGUF) runs without torch: the engine's adapter
    manager loads adapters on servers whose runner is not torch's."""
    code = ("import sys, kvflow.lora, kvflow.lora.synthetic, kvflow.lora.gguf_format, "
            "kvflow.lora.peft_format; print(sorted(m for m in ('torch', 'peft', 'transformers') "
            "if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=Path(__file__).parent.parent, check=True)
    assert done.stdout.strip() == "[]"
