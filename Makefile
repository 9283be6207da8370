# Two commands on a fresh machine with Python >= 3.11 (README, "Set up"):
#
#   make digits   install weft, then train the digits example from random weights and print
#                 its held-out accuracy (about 5 minutes on 2 CPU cores, installs included)
#   make test     install the test extra, then the linter and the whole suite (.ci/run runs this)
#
# A Makefile because it is what the field runs its checks with (transformers' `make test`,
# `make quality`) and what a fresh Linux or macOS machine already has; each target is the
# README's own commands, so nothing here is needed to use weft: `pip install weft` suffices.
# TORCH picks the torch wheel: the CPU build this machine holds by default; on a GPU host
# `make test TORCH=torch` (or any torch >= 2.11 already in the venv).

PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
BIN := $(VENV)/bin

.PHONY: digits test

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)"

# Stamps: an extra is installed again when pyproject.toml changes.
$(VENV)/.installed-digits: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e ".[digits]"
	touch $@

$(VENV)/.installed-test: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e ".[test,video]"
	touch $@

# OMP_NUM_THREADS=1: one process of a 0.6M-parameter model; on a busy machine more threads
# made the same steps several times slower (examples/digits/digits.toml).
digits: $(VENV)/.installed-digits
	$(BIN)/python examples/digits/make_digits.py examples/digits/data
	OMP_NUM_THREADS=1 $(BIN)/weft run examples/digits/digits.toml --run-dir runs/digits
	$(BIN)/weft eval examples/digits/digits.toml --run-dir runs/digits --task examples/digits/data/held_out.jsonl \
		--results runs/digits/held_out.results.jsonl

test: $(VENV)/.installed-test
	$(BIN)/ruff check .
	# Three workers on the 2 cores, a test file each (module fixtures made once), one thread each:
	# much of a worker's time waits on process starts, forked ranks and the fault tests' timeouts,
	# which a third worker fills (a fresh-clone .ci/run, 2026-12-06: 569 s where two took 648).
	# The longest files first (tests/conftest.py LONGEST_FIRST), in the order collected.
	$(BIN)/python -m pytest -q -n 3 --dist loadfile --no-loadscope-reorder
