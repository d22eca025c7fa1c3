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

# The demo: a tiny model served by `berth serve` on a free port, asked one question by the
# official `openai` client (examples/openai_client.py), then stopped. Fails if the server
# does not come up (its log is shown) or the request fails; the server never outlives it.
DEMO_LOG := .cache/demo-serve.log

demo: venv
	$(BIN)/berth make-tiny-model $(MODEL)
	@$(BIN)/berth serve $(MODEL) --port 0 --served-model-name tiny-llama >$(DEMO_LOG) 2>&1 & server=$$!; \
	trap 'kill $$server 2>/dev/null; wait $$server 2>/dev/null' EXIT; trap 'exit 130' INT TERM; \
	url=; \
	for i in $$(seq 240); do \
		url=$$(sed -n 's/^berth serve: listening on //p' $(DEMO_LOG)); \
		if [ -n "$$url" ] || ! kill -0 $$server 2>/dev/null; then break; fi; \
		sleep 0.5; \
	done; \
	if [ -z "$$url" ]; then echo "demo: berth serve did not come up:" >&2; cat $(DEMO_LOG) >&2; exit 1; fi; \
	echo "demo: berth serve listens at $$url (log: $(DEMO_LOG))"; \
	$(BIN)/python examples/openai_client.py --base-url $$url/v1 --wait-ready 30

test: venv
	$(BIN)/python -m pytest -q

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

clean:
	rm -rf $(VENV) .cache
