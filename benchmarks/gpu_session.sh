#!/usr/bin/env bash
# Everything a session lent one NVIDIA GPU runs, as one prepared command (issue 8):
#
#   the device tool:  run  command="bash benchmarks/gpu_session.sh"  timeout_s=560
#   anywhere else:    OUT=reports/gpu_session bash benchmarks/gpu_session.sh
#
# 1. The GPU tests: the Triton kernels compiled against the reference, the CUDA runner
#    against the torch runner, decode CUDA graphs captured and replayed against eager steps,
#    and the TensorRT engine when TensorRT is importable (it skips, saying why, when not).
# 2. benchmarks/gpu_check.py: kernel errors, decode-attention bandwidth, the CUDA runner's
#    step times and throughput against HF generate, TensorRT.
#
# It needs only the device image's packages (torch, triton, transformers, onnx,
# onnxruntime, onnxscript, safetensors, tokenizers): nothing is installed, kvflow is imported
# from the working tree. Logs and the JSON figures go to $OUT.
set -u -o pipefail
OUT=${OUT:-reports/gpu_session}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
status=0
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    python3 -c "import torch, triton, transformers; print('torch', torch.__version__,
'triton', triton.__version__, 'transformers', transformers.__version__)"
} 2>&1 | tee "$OUT/versions.txt"
echo "== GPU tests"
timeout 240 python3 -m pytest -q -p no:cacheprovider -o addopts="" \
    tests/test_triton_kernels.py tests/test_gpu_path.py 2>&1 | tee "$OUT/pytest.log" || status=1
echo "== gpu_check"
timeout 300 python3 benchmarks/gpu_check.py --out "$OUT/gpu_check.json" 2>&1 \
    | tee "$OUT/gpu_check.log" || status=1
exit $status
