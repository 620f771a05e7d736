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
# coverage and tracebacks see inside the kernels).
test: install
	$(PY) -m pytest -q --durations=15
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
