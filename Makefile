# The two commands a new user needs are `make demo` and `make test`; both set up .venv.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: demo test setup gen typecheck bench clean

setup:
	@./scripts/setup.sh

demo: setup
	$(PY) -m pdgrpc.cluster.demo

test: setup
	$(PY) -m pytest $(PYTEST_ARGS)

# Regenerate pdgrpc/v1 from protos/ (generated files are committed; a test checks they match).
gen: setup
	$(PY) scripts/gen_protos.py

# The whole package in mypy's default mode (files in pyproject.toml), then state and metrics strictly.
typecheck: setup
	$(PY) -m mypy
	$(PY) -m mypy --strict pdgrpc/state pdgrpc/metrics

# One benchmark, e.g. `make bench BENCH=e2e` (python -m pdgrpc.bench --help lists them).
BENCH ?= state
bench: setup
	$(PY) -m pdgrpc.bench $(BENCH) $(BENCH_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache
