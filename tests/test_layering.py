"""The orchestration core stays pure Python: the simulator must run it without any runtime."""

from __future__ import annotations

import subprocess
import sys


def test_orchestrator_and_kv_manager_import_no_runtime():
    code = (
        "import sys\n"
        "import kvflow.kv_manager, kvflow.orchestrator.engine, kvflow.orchestrator.llm\n"
        "import kvflow.orchestrator.async_engine, kvflow.orchestrator.scheduler\n"
        "import kvflow.sim.simulator, kvflow.sim.cost_model, kvflow.bench.workloads\n"
        "heavy = [m for m in ('torch', 'onnxruntime', 'tensorrt', 'triton_python_backend_utils',"
        " 'transformers') if m in sys.modules]\n"
        "print(','.join(heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"imported: {out.stdout.strip()}"
