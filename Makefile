# ckptvault: every target sets itself up on a fresh machine (Python 3.10+, no torch needed beforehand).
#
#   make demo    train a small GPT with checkpoints, restore in a fresh process, compare with torch.save
#   make test    run the test suite (slow tests excluded; `make test PYTEST_ARGS='-m slow'` runs them)
#   make lint    ruff, then mypy (its settings, and the files it checks: [tool.mypy] in pyproject.toml)
#   make bench   the core benchmark (about 1 GB of state; several minutes)
#   make clean   remove the demo vault, caches and build outputs (`make distclean` also removes .venv)
#
# torch is pinned here, in the set-up path, and installed FIRST: `pip install -e .` on its own would
# resolve `torch>=2.2,<3` to the newest release, a multi-GB CUDA build.

PYTHON ?= python3
TORCH_VERSION ?= 2.13.0
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.ckptvault-installed
DEMO_ARGS ?= --fresh
PYTEST_ARGS ?=
BENCH_ARGS ?= --size full --runs 3
# OpenMP threads that spin-wait make torch ~6x slower when other processes share the 2 cores (measured: 3.2 s
# vs 0.5 s per demo step under load); passive waiting does not change any result. Set it to override.
export OMP_WAIT_POLICY ?= PASSIVE

.PHONY: all install demo test lint bench clean distclean

all: test

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# Re-run only when pyproject.toml changes (or the venv is new): `make test` is quick once set up.
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --disable-pip-version-check "torch==$(TORCH_VERSION)"
	$(BIN)/python -m pip install --disable-pip-version-check -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/ckptvault demo $(DEMO_ARGS)

test: $(STAMP)
	$(BIN)/pytest $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check src tests bench
	$(BIN)/mypy

bench: $(STAMP)
	$(BIN)/python bench/bench_core.py $(BENCH_ARGS)

clean:
	rm -rf demo-vault .ckptvault-demo-* bench/out build dist .pytest_cache .ruff_cache .mypy_cache .hypothesis
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -print0 | xargs -0 rm -rf

distclean: clean
	rm -rf $(VENV)
