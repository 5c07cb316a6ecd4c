# Two commands set everything up on a fresh machine:
#   make demo   creates .venv, installs hybridkv, runs the main job on the shipped model
#   make test   same setup, then the test suite
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# pytest processes (pytest-xdist; each test file runs whole in one of them): 2 fills CI's two cores
TEST_WORKERS ?= 2

.PHONY: demo test venv clean

$(STAMP): pyproject.toml requirements-cpu.txt
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "hybridkv needs Python >= 3.11 (set PYTHON=...)")'
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements-cpu.txt
	$(PY) -m pip install -q -e '.[dev]'
	@touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/hybridkv demo

test: $(STAMP)
	@$(PY) -m pytest -q --durations=25 -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS); rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests collected"; exit 0; fi; exit $$rc

clean:
	rm -rf $(VENV) build *.egg-info
