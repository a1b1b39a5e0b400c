# Set-up and the two entry points. `make demo` and `make test` work on a fresh machine with only Python 3.10+.
# torch is installed first from $(TORCH) so pip never pulls a different (multi-GB CUDA) build as a dependency;
# on a GPU machine install your CUDA torch into the venv first, or run `make TORCH=torch demo`.
VENV  ?= .venv
PY    := $(VENV)/bin/python
TORCH ?= torch==2.13.0
STAMP := $(VENV)/.dcache-installed

# The edit-test loop: invariants (plans, engine, memo, layering, doc links), the conformance matrix on one family
# (FLUX: stack, block and module units), every method on the toy model, the bundled pipeline; `slow` tests left out.
QUICK := tests/core/test_plan.py tests/core/test_engine_toy.py tests/core/test_memo.py tests/meta/test_packaging.py \
         tests/meta/test_doc_links.py tests/schedules/test_methods.py tests/pipelines/test_tiny_model.py \
         "tests/conformance/test_conformance.py::test_all_compute_and_remove_are_bit_identical[flux]" \
         "tests/conformance/test_conformance.py::test_reuse_skips_blocks_and_stays_close[flux-stack]" \
         "tests/conformance/test_conformance.py::test_reuse_skips_blocks_and_stays_close[flux-block]" \
         "tests/conformance/test_conformance.py::test_reuse_skips_blocks_and_stays_close[flux-module]" \
         "tests/conformance/test_conformance.py::test_dynamic_plan_replays_bit_exactly[flux]"
# the method matrix on the toy model only: its zoo-family runs, grad-mode and branch-state variants run in `make test`
QUICK_SKIP := not zoo_family and not inference_mode_no_grad and not branches_keep_separate

.PHONY: setup demo test test-quick clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	@echo "[setup 1/4] virtualenv in $(VENV)"
	python3 -m venv $(VENV)
	@echo "[setup 2/4] pip"
	$(PY) -m pip install --progress-bar on --upgrade pip
	@echo "[setup 3/4] $(TORCH) (the largest download: a few minutes)"
	$(PY) -m pip install --progress-bar on "$(TORCH)"
	@echo "[setup 4/4] dcache and its dev extra (diffusers, transformers, pytest, ...)"
	$(PY) -m pip install --progress-bar on -e ".[dev]"
	touch $(STAMP)

demo: setup
	$(VENV)/bin/dcache generate

# one pytest worker per core (pytest-xdist), each test file in one worker (files share module-scoped fixtures);
# the files in the order tests/conftest.py gives (longest first), not reordered by their number of tests
test: setup
	$(PY) -m pytest -n auto --dist loadfile --no-loadscope-reorder

test-quick: setup
	$(PY) -m pytest -m "not slow" -k "$(QUICK_SKIP)" $(QUICK)

clean:
	rm -rf $(VENV) dcache-out .pytest_cache
