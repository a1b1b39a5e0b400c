# Set-up and the two entry points. `make demo` and `make test` work on a fresh machine with only Python 3.10+.
# torch is installed first from $(TORCH) so pip never pulls a different (multi-GB CUDA) build as a dependency;
# on a GPU machine install your CUDA torch into the venv first, or run `make TORCH=torch demo`.
VENV  ?= .venv
PY    := $(VENV)/bin/python
TORCH ?= torch==2.13.0
STAMP := $(VENV)/.dcache-installed

.PHONY: setup demo test clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH)"
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

demo: setup
	$(VENV)/bin/dcache generate

test: setup
	$(PY) -m pytest

clean:
	rm -rf $(VENV) dcache-out .pytest_cache
