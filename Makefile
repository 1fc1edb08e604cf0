# The two commands of the README: `make run` (the main job) and `make test` (the test suite).
# Both build .venv once. torch==2.13.0 is installed first, pinned: pip takes that
# CPU build from a local wheel, while an unpinned `torch` (as pulled in by our `torch>=2.4`
# dependency with no torch present) would download a multi-GB CUDA build.
# FLAVOUR is the extra with the CuPy and NVRTC for torch's CUDA: cu12 (CUDA 12 and CPU builds) or cu13.
# `make test` also runs the suite's other environments: a CuPy and NVRTC for CUDA 13 (test-cu13),
# the newest transformers the integration supports (test-transformers-latest), and the real vLLM
# and SGLang code (test-frameworks, in .venv-frameworks: the same torch and flashjit, then the
# frameworks with --no-deps, since their wheels pin other torch builds and GPU-only packages, then
# each tests/frameworks/*/requirements.txt with its dependencies and requirements-nodeps.txt
# without, for packages whose declared dependencies would pull in GPU toolchains).

PYTHON   ?= python3
VENV     ?= .venv
BIN      := $(VENV)/bin
TORCH    ?= torch==2.13.0
FLAVOUR  ?= cu12
CU13     := .venv-cu13
TRANSFORMERS_OLDEST ?= transformers==5.17.0
TRANSFORMERS_LATEST ?= transformers==5.23.0
LATEST   := .transformers-latest
FVENV    ?= .venv-frameworks
FBIN     := $(FVENV)/bin
FRAMEWORKS ?= vllm==0.33.0 sglang==0.5.23
FRAMEWORK_REQS := $(wildcard tests/frameworks/*/requirements.txt)
FRAMEWORK_NODEPS := $(wildcard tests/frameworks/*/requirements-nodeps.txt)

.PHONY: run test test-cu13 test-transformers-latest test-frameworks install clean

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install $(TORCH)
	$(BIN)/pip install -e '.[$(FLAVOUR)]'
	touch $@

# The suite runs against the oldest transformers the integration supports; test-transformers-latest
# against the newest.
$(BIN)/.installed-test: $(BIN)/.installed
	$(BIN)/pip install -e '.[$(FLAVOUR),test]' '$(TRANSFORMERS_OLDEST)'
	touch $@

install: $(BIN)/.installed

run: $(BIN)/.installed
	$(BIN)/flashjit run-example

test: $(BIN)/.installed-test
	$(BIN)/python -m pytest -q
	$(MAKE) test-cu13 test-transformers-latest test-frameworks

# A venv holding only cupy-cuda13x and NVRTC 13, reading everything else from .venv (a .pth line):
# cuda-pathfinder searches its site-packages first, so CuPy loads the CUDA 13 NVRTC.
$(CU13)/.installed: $(BIN)/.installed-test
	$(PYTHON) -m venv $(CU13)
	$(BIN)/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])" > \
		"$$($(CU13)/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/flashjit-base-venv.pth"
	$(CU13)/bin/pip install --no-deps 'cupy-cuda13x>=14' 'nvidia-cuda-nvrtc>=13.0,<14'
	touch $@

test-cu13: $(CU13)/.installed
	FLASHJIT_CU13_PYTHON=$(CU13)/bin/python $(BIN)/python -m pytest -q tests/test_cuda_flavour.py

# The newest supported transformers in a folder ahead of .venv's on the path (.venv holds the oldest).
$(LATEST)/.installed: $(BIN)/.installed-test
	$(BIN)/pip install --no-deps --target $(LATEST) '$(TRANSFORMERS_LATEST)'
	touch $@

test-transformers-latest: $(LATEST)/.installed
	PYTHONPATH=$(LATEST) $(BIN)/python -m pytest -q tests/integrations/transformers \
		tests/benchmarks/test_transformers_benchmark.py

$(FBIN)/.installed: pyproject.toml $(FRAMEWORK_REQS) $(FRAMEWORK_NODEPS)
	$(PYTHON) -m venv $(FVENV)
	$(FBIN)/pip install -q $(TORCH)
	$(FBIN)/pip install -q -e '.[$(FLAVOUR),test]' '$(TRANSFORMERS_OLDEST)'
	$(FBIN)/pip install -q --no-deps $(FRAMEWORKS)
	for f in $(FRAMEWORK_REQS); do $(FBIN)/pip install -q -r $$f || exit 1; done
	for f in $(FRAMEWORK_NODEPS); do $(FBIN)/pip install -q --no-deps -r $$f || exit 1; done
	touch $@

test-frameworks: $(FBIN)/.installed
	FLASHJIT_FRAMEWORK_TESTS=1 $(FBIN)/python -m pytest -q tests/frameworks

clean:
	rm -rf $(VENV) $(CU13) $(LATEST) $(FVENV)
