# Every step a fresh machine needs lives here; README.md names the two entry points.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
MODEL  := .cache/tiny-model
# mpich's mpiexec lives in the venv: MPI spawning needs it on PATH.
export PATH := $(CURDIR)/$(BIN):$(PATH)

.PHONY: venv demo test lint clean

venv: $(VENV)/.installed

# torch first, pinned to the CPU build on this disk (an unpinned torch pulls a multi-GB CUDA build).
$(VENV)/.installed: pyproject.toml setup.py constraints-cpu.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q -c constraints-cpu.txt torch
	$(BIN)/pip install -q -c constraints-cpu.txt -e '.[dev]'
	touch $@

demo: venv
	$(BIN)/berth make-tiny-model $(MODEL)
	$(BIN)/berth generate $(MODEL) --prompt "The capital of France is" --max-tokens 32

test: venv
	$(BIN)/python -m pytest -q

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

clean:
	rm -rf $(VENV) .cache
