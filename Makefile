# The two commands of the README: `make run` (the main job) and `make test` (the test suite).
# Both build .venv once. torch==2.13.0 is installed first, pinned: pip takes that
# CPU build from a local wheel, while an unpinned `torch` (as pulled in by our `torch>=2.4`
# dependency with no torch present) would download a multi-GB CUDA build.

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
TORCH  ?= torch==2.13.0

.PHONY: run test install clean

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install $(TORCH)
	$(BIN)/pip install -e '.[test]'
	touch $@

install: $(BIN)/.installed

run: $(BIN)/.installed
	$(BIN)/flashjit run-example

test: $(BIN)/.installed
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV)
