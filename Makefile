# The two commands of the README: `make run` (the main job) and `make test` (the test suite).
# Both build .venv once. torch==2.13.0 is installed first, pinned: pip takes that
# CPU build from a local wheel, while an unpinned `torch` (as pulled in by our `torch>=2.4`
# dependency with no torch present) would download a multi-GB CUDA build.
#
# `make test` also builds .venv-frameworks, where tests/frameworks runs against the real vLLM and
# SGLang code: the same torch, flashjit, then the frameworks with --no-deps (their wheels pin other
# torch builds and GPU-only packages), then each tests/frameworks/*/requirements.txt (the small
# packages their imports need, with their dependencies) and requirements-nodeps.txt (packages
# whose declared dependencies would pull in GPU toolchains, installed alone).

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
TORCH  ?= torch==2.13.0
FVENV  ?= .venv-frameworks
FBIN   := $(FVENV)/bin
FRAMEWORKS ?= vllm==0.33.0 sglang==0.5.23
FRAMEWORK_REQS := $(wildcard tests/frameworks/*/requirements.txt)
FRAMEWORK_NODEPS := $(wildcard tests/frameworks/*/requirements-nodeps.txt)

.PHONY: run test test-frameworks install clean

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install $(TORCH)
	$(BIN)/pip install -e '.[test]'
	touch $@

$(FBIN)/.installed: pyproject.toml $(FRAMEWORK_REQS) $(FRAMEWORK_NODEPS)
	$(PYTHON) -m venv $(FVENV)
	$(FBIN)/pip install -q $(TORCH)
	$(FBIN)/pip install -q -e '.[test]'
	$(FBIN)/pip install -q --no-deps $(FRAMEWORKS)
	for f in $(FRAMEWORK_REQS); do $(FBIN)/pip install -q -r $$f || exit 1; done
	for f in $(FRAMEWORK_NODEPS); do $(FBIN)/pip install -q --no-deps -r $$f || exit 1; done
	touch $@

install: $(BIN)/.installed

run: $(BIN)/.installed
	$(BIN)/flashjit run-example

test: $(BIN)/.installed $(FBIN)/.installed
	$(BIN)/python -m pytest -q
	FLASHJIT_FRAMEWORK_TESTS=1 $(FBIN)/python -m pytest -q tests/frameworks

test-frameworks: $(FBIN)/.installed
	FLASHJIT_FRAMEWORK_TESTS=1 $(FBIN)/python -m pytest -q tests/frameworks

clean:
	rm -rf $(VENV) $(FVENV)
