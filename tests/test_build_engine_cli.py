"""`kvflow build-engine` refuses bad arguments with a message naming the argument."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvflow.cli import main


def run_cli(capsys, *argv: str) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exc:
        main(["build-engine", *argv])
    return int(exc.value.code), capsys.readouterr().err


def test_missing_model_file(capsys, tmp_path):
    code, err = run_cli(capsys, "--model", str(tmp_path / "nope.gguf"), "--output",
                        str(tmp_path / "e"))
    assert code == 2 and "--model" in err and "no such file" in err


def test_unknown_architecture(capsys, tmp_path):
    folder = tmp_path / "gpt2"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"],
                                                    "model_type": "gpt2"}))
    code, err = run_cli(capsys, "--model", str(folder), "--output", str(tmp_path / "e"))
    assert code == 2 and "unknown architecture" in err and "GPT2LMHeadModel" in err


@pytest.mark.parametrize("block", ["3", "12", "0"])
def test_block_size_must_be_a_power_of_two(capsys, tmp_path, block):
    code, err = run_cli(capsys, "--model", "default", "--output", str(tmp_path / "e"),
                        "--block-size", block)
    assert code == 2 and "--block-size" in err


def test_max_num_tokens_below_block_size(capsys, tmp_path):
    code, err = run_cli(capsys, "--model", "default", "--output", str(tmp_path / "e"),
                        "--block-size", "32", "--max-num-tokens", "16")
    assert code == 2 and "--max-num-tokens (16) must be >= --block-size (32)" in err


def test_dtype_the_backend_cannot_run(capsys, tmp_path):
    code, err = run_cli(capsys, "--model", "default", "--output", str(tmp_path / "e"),
                        "--backend", "onnxruntime", "--dtype", "float16")
    assert code == 2 and "--dtype" in err and "onnxruntime" in err


def test_tensorrt_without_gpu_says_so_plainly(capsys, tmp_path):
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the TensorRT build is tested in the GPU suite")
    code, err = run_cli(capsys, "--model", "default", "--output", str(tmp_path / "e"),
                        "--backend", "tensorrt")
    assert code == 2 and "--backend tensorrt cannot build here" in err


def test_max_model_len_beyond_the_model(capsys, tiny_models, tmp_path):
    folder, _ = tiny_models["llama-gqa4"]
    code, err = run_cli(capsys, "--model", str(folder), "--output", str(tmp_path / "e"),
                        "--max-model-len", "100000")
    assert code == 2 and "--max-model-len 100000 exceeds the model's limit of 512" in err


@pytest.mark.slow
def test_console_script_shortcut_builds_an_engine(tiny_models, tmp_path):
    folder, _ = tiny_models["llama-mha-tied"]
    out = tmp_path / "engine"
    proc = subprocess.run(
        [sys.executable, "-c", "import sys; from kvflow.cli import build_engine_main; "
         "sys.exit(build_engine_main(sys.argv[1:]))", "--model", str(folder), "--output",
         str(out), "--backend", "torch", "--block-size", "8", "--max-model-len", "128"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "[4/4] engine written" in proc.stdout
    config = json.loads((out / "engine_config.json").read_text())
    assert config["limits"]["block_size"] == 8 and config["backend"] == "torch"
    for name in ("tokenizer.json", "tokenizer_config.json", "weights.safetensors"):
        assert (out / name).is_file(), name
