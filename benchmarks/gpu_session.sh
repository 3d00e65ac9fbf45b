#!/usr/bin/env bash
# Everything a session lent one NVIDIA GPU runs, as one prepared command (issue 8):
#
#   the device tool:  run  command="bash benchmarks/gpu_session.sh"  carry=[".whl"]  timeout_s=560
#   anywhere else:    OUT=reports/gpu_session bash benchmarks/gpu_session.sh
#
# 1. TensorRT first (benchmarks/gpu_check.py --parts tensorrt): a float16 engine built with
#    Polygraphy, `kvflow check-engine` against ONNX Runtime on its recorded steps, the
#    cuda-python runner's step times. Without TensorRT it says why and goes on.
# 2. The GPU tests: the Triton kernels compiled against the reference, the CUDA runner
#    against the torch runner, decode CUDA graphs captured and replayed against eager steps,
#    and the TensorRT engine when TensorRT is importable (it skips, saying why, when not).
#    Then the KV tiers on the device pools (tests/test_kv_tiers_device.py, seconds): the
#    Triton runner's and the cuda-python (TensorRT runner's) pools copy blocks out and back
#    as the host pool's bytes, and a prefix restored from the disk tier gives the cold
#    prefill's greedy tokens. Log: $OUT/kv_tiers_device.log.
# 3. benchmarks/gpu_check.py: kernel errors, decode-attention bandwidth, the CUDA runner's
#    step times and throughput against HF generate.
#
# The device image has torch, triton, transformers, onnx, onnxruntime, onnxscript,
# safetensors, tokenizers and cuda-bindings; not Polygraphy or TensorRT. Wheels found in .whl/
# are installed into /tmp/site first: fetch Polygraphy's there with the device README's
# `pip download` line (polygraphy==0.53.6). TensorRT's libraries come only from
# pypi.nvidia.com (PyPI's tensorrt-cu13-libs is a stub that downloads them), which neither
# this project's machines nor the device can reach, and they are far over the 64 MiB a call
# may carry. kvflow is imported from the working tree. Logs and the JSON figures go to $OUT.
set -u -o pipefail
OUT=${OUT:-reports/gpu_session}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
status=0
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    python3 -c "import torch, triton, transformers; print('torch', torch.__version__,
'triton', triton.__version__, 'transformers', transformers.__version__)"
    python3 -c "import cuda.bindings, polygraphy; print('cuda-bindings',
cuda.bindings.__version__, 'polygraphy', polygraphy.__version__)"
    python3 -c "import tensorrt; print('tensorrt', tensorrt.__version__)"
} 2>&1 | tee "$OUT/versions.txt"
echo "== TensorRT: Polygraphy build, check-engine, the cuda-python runner"
timeout 120 python3 benchmarks/gpu_check.py --parts tensorrt --out "$OUT/tensorrt.json" 2>&1 \
    | tee "$OUT/tensorrt.log" || status=1
echo "== GPU tests"
timeout 180 python3 -m pytest -q -p no:cacheprovider -o addopts="" \
    tests/test_triton_kernels.py tests/test_gpu_path.py 2>&1 | tee "$OUT/pytest.log" || status=1
echo "== KV tiers on the device pools"
timeout 90 python3 -m pytest -q -rs -p no:cacheprovider -o addopts="" \
    tests/test_kv_tiers_device.py 2>&1 | tee "$OUT/kv_tiers_device.log" || status=1
echo "== gpu_check"
timeout 270 python3 benchmarks/gpu_check.py --parts kernels,bandwidth,runner \
    --out "$OUT/gpu_check.json" 2>&1 \
    | tee "$OUT/gpu_check.log" || status=1
exit $status
