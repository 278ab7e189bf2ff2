# All set-up happens here: each target creates .venv and installs what it needs, at the
# versions pinned in requirements.lock (every direct and transitive dependency).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
LOCK := requirements.lock
STAMP := $(VENV)/.installed
BENCH_STAMP := $(VENV)/.installed-bench
PIP_TOOLS := pip-tools==7.6.2

.PHONY: demo test bench browser install lock clean

$(STAMP): pyproject.toml $(LOCK)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -c $(LOCK) -e ".[peers,test,ray,triton]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/opweave demo

$(BENCH_STAMP): $(STAMP)
	$(PY) -m pip install --quiet -c $(LOCK) -e ".[peers,test,ray,triton,bench]"
	touch $(BENCH_STAMP)

# every backend on the five models; ARGS passes options, e.g. make bench ARGS="--mode train"
bench: $(BENCH_STAMP)
	$(VENV)/bin/opweave bench $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -q -n 2 --durations=10

# Chromium for the test that opens `opweave profile --html`'s report in a real browser
# (tests/profiling/test_browser.py; skipped, saying so, without it). Debian's package:
browser:
	apt-get update -q && apt-get install -y -q chromium

# Re-resolve every dependency after editing pyproject.toml (tests/test_lock.py fails
# until the lock agrees with it).
lock:
	$(PYTHON) -m venv .venv-lock
	.venv-lock/bin/pip install --quiet "$(PIP_TOOLS)"
	.venv-lock/bin/pip-compile --quiet --strip-extras --allow-unsafe --all-extras \
		--no-emit-find-links --no-emit-index-url --output-file $(LOCK) pyproject.toml

clean:
	rm -rf $(VENV) .venv-lock build src/*.egg-info .pytest_cache
