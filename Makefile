# All set-up happens here: each target creates .venv and installs what it needs.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

BENCH_STAMP := $(VENV)/.installed-bench

.PHONY: demo test bench install clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet "torch==2.13.0"
	$(PY) -m pip install --quiet -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/opweave demo

$(BENCH_STAMP): $(STAMP)
	$(PY) -m pip install --quiet -e ".[test,bench]"
	touch $(BENCH_STAMP)

# every backend on the five models; ARGS passes options, e.g. make bench ARGS="--mode train"
bench: $(BENCH_STAMP)
	$(VENV)/bin/opweave bench $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -q -n 2 --durations=10

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
