"""lm-evaluation-harness, unchanged, against the OpenAI frontend: ``lm_eval --model
local-completions`` runs a loglikelihood task (multiple choice: echo, logprobs, no generation)
and a generation task (stop strings) from tests/data/lm_eval over local JSON files. The
tokenizer is the engine folder's own (``tokenizer_backend=huggingface``): no hub access."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")

ROOT = Path(__file__).resolve().parent.parent
TASKS = ROOT / "tests" / "data" / "lm_eval"
MODEL = "smollm2-135m-instruct"


@pytest.mark.slow
def test_lm_eval_runs_a_loglikelihood_and_a_generation_task(openai_frontend, default_engines,
                                                            tmp_path):
    lm_eval = shutil.which("lm_eval", path=str(Path(sys.executable).parent))
    assert lm_eval is not None, "lm-eval is installed, but not its lm_eval command"
    model_args = ",".join([
        f"model={MODEL}", f"base_url={openai_frontend.url}/v1/completions",
        "tokenizer_backend=huggingface", f"tokenizer={default_engines['onnxruntime']}",
        "num_concurrent=1", "max_retries=1", "timeout=300"])
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "HF_HOME": str(tmp_path / "hf"), "TOKENIZERS_PARALLELISM": "false"}
    run = subprocess.run(
        [lm_eval, "--model", "local-completions", "--model_args", model_args,
         "--tasks", "kvflow_mc,kvflow_gen", "--include_path", str(TASKS),
         "--output_path", str(tmp_path / "out"), "--batch_size", "1", "--log_samples"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    results = json.loads(next((tmp_path / "out").rglob("results_*.json")).read_text())
    mc, gen = results["results"]["kvflow_mc"], results["results"]["kvflow_gen"]
    assert 0.0 <= mc["acc,none"] <= 1.0 and 0.0 <= gen["exact_match,none"] <= 1.0
    assert results["n-samples"]["kvflow_mc"]["effective"] == 5
    assert results["n-samples"]["kvflow_gen"]["effective"] == 4
    # Each multiple-choice item scored all its choices: a loglikelihood per choice, finite.
    samples = [json.loads(line) for path in (tmp_path / "out").rglob("samples_kvflow_mc_*")
               for line in path.read_text().splitlines()]
    assert len(samples) == 5
    for sample in samples:
        scores = [r[0][0] if isinstance(r[0], list) else r[0] for r in sample["resps"]]
        assert len(scores) == 3 and all(float(s) < 0.0 for s in scores)
