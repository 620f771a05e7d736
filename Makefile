# Two commands on a fresh machine: `make train` (the main job) and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: install lock test test-long compile test-nojit bench train clean

install: $(STAMP)

lock: install
	$(VENV)/bin/uv pip compile pyproject.toml --all-extras --universal --python-version 3.10 --upgrade -q -o constraints.txt

# uv resolves and installs the same packages as pip from PyPI, in ~45 s where pip took ~2 min
# of CI's 20 (measured 2026-11-28, fresh venv). --compile-bytecode: pip writes .pyc files of what it
# installs and uv by default does not; where PYTHONDONTWRITEBYTECODE is set, every process would compile
# numpy, numba and grpc again. Without uv (no wheel for this platform), pip does the same install.
# constraints.txt pins every package (and each package's dependencies) to the versions the suite passed
# with, for every Python from 3.10 (`uv pip compile --universal`: markers where versions differ): a fresh install gets what was tested,
# not whatever PyPI released since (a new ray, numba or moto breaking CI on a day nobody changed a line).
# pyproject.toml keeps the ranges the code supports; `make lock` moves the pins to the newest releases
# within them (then run `make test` before committing the new file).
$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q uv || echo "uv could not be installed: installing with pip (slower)"
	if [ -x $(VENV)/bin/uv ]; then \
	  $(VENV)/bin/uv pip install -q --compile-bytecode --python $(PY) -c constraints.txt -e '.[test,bench,ray,hybrid]'; \
	else \
	  $(PY) -m pip install -q --upgrade pip && $(PY) -m pip install -q -c constraints.txt -e '.[test,bench,ray,hybrid]'; \
	fi
	touch $(STAMP)

# The whole suite, then the kernel tests again with Numba's JIT off (pure Python, so
# coverage and tracebacks see inside the kernels). The suite runs on TEST_WORKERS processes, a whole
# test file to each at a time (pytest-xdist --dist loadfile: a file's module fixtures and the Ray
# cluster are made once, and its tests never run against each other). An integration test spends much of
# its time waiting (timeouts, restarts, peers), so 2 processes on 2 cores took the integration tests from
# 1005 s to 583 s; the no-JIT pass too (pure-Python kernels, CPU-bound: 47 s -> 38 s on 2026-11-28).
# TEST_WORKERS=0 runs the suite in this one process.
# Tests marked `long` (end-to-end variants of capabilities that `make test` covers; pyproject.toml) keep
# CI within 20 minutes on a slow 2-core machine; `make test-long` runs them.
# `compile`: the environment may set PYTHONDONTWRITEBYTECODE, and then every process a test starts
# (servers, workers, restarts: hundreds) compiled the project's sources again, ~10% of the suite's CPU.
TEST_WORKERS ?= 2
test: install compile
	$(PY) -m pytest -q --durations=15 -n $(TEST_WORKERS) --dist loadfile -m "not long"
	NUMBA_DISABLE_JIT=1 $(PY) -m pytest -q -n $(TEST_WORKERS) -m nojit -p no:cacheprovider

test-long: install compile
	$(PY) -m pytest -q --durations=15 -n $(TEST_WORKERS) --dist loadfile -m long

# Bytecode of the project's packages (Python reads .pyc files even where it may not write them).
compile: install
	$(PY) -m compileall -q engine sparse_tables models streaming hdfs_io tests bench

# Every benchmark in bench/, one after the other (heavy: never run from CI).
bench: install
	for b in bench/*_bench.py; do echo "== $$b"; $(PY) $$b $(BENCH_ARGS) || exit 1; done

# The main job: trains CTR-DNN on ../shared/data/criteo/train.txt (or, when absent, on a generated
# planted-model file; the job says which). TRAIN_ARGS="--set mode=geo" etc. pass through.
train: install compile
	$(VENV)/bin/engine train configs/ctr.yaml $(TRAIN_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
