# Two commands on a fresh machine: `make train` (the main job) and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: install test test-nojit bench train clean

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,bench,ray,hybrid]'
	touch $(STAMP)

# The whole suite, then the kernel tests again with Numba's JIT off (pure Python, so
# coverage and tracebacks see inside the kernels). The suite runs on TEST_WORKERS processes, a whole
# test file to each at a time (pytest-xdist --dist loadfile: a file's module fixtures and the Ray
# cluster are made once, and its tests never run against each other). An integration test spends much of
# its time waiting (timeouts, restarts, peers), so 2 processes on 2 cores took the integration tests from
# 1005 s to 583 s. TEST_WORKERS=0 runs the suite in this one process.
TEST_WORKERS ?= 2
test: install
	$(PY) -m pytest -q --durations=15 -n $(TEST_WORKERS) --dist loadfile
	NUMBA_DISABLE_JIT=1 $(PY) -m pytest -q -m nojit -p no:cacheprovider

# Every benchmark in bench/, one after the other (heavy: never run from CI).
bench: install
	for b in bench/*_bench.py; do echo "== $$b"; $(PY) $$b $(BENCH_ARGS) || exit 1; done

# The main job: trains CTR-DNN on ../shared/data/criteo/train.txt (or, when absent, on a generated
# planted-model file; the job says which). TRAIN_ARGS="--set mode=geo" etc. pass through.
train: install
	$(VENV)/bin/engine train configs/ctr.yaml $(TRAIN_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
