# `make demo` and `make test` set up .venv at the repo root when it is missing or older than
# the project's dependency files, then run.
PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: demo test lint docs bench clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(VENV)/bin/python -m pip install -q -c constraints.txt torch==2.14.1 torchvision==0.29.1
	$(VENV)/bin/python -m pip install -q -c constraints.txt -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/lms demo --out out/demo

# The tests that measure nothing on two workers, a file to each; then those that measure a process's
# memory or plan on this CPU's measured rates (marked serial), alone, since a neighbour's load shifts
# when the runtime's copies land and what the CPU measures.
test: $(STAMP)
	$(VENV)/bin/python -m pytest -q -n 2 --dist loadfile -m 'not serial'
	$(VENV)/bin/python -m pytest -q -m serial

# The API reference from the docstrings; a warning fails it.
docs: $(STAMP)
	$(VENV)/bin/python -m sphinx -W --keep-going -q -b html docs docs/_build/html

lint: $(STAMP)
	$(VENV)/bin/ruff check lms tests benchmarks examples
	$(VENV)/bin/ruff format --check lms tests benchmarks examples
	$(VENV)/bin/mypy lms

bench: $(STAMP)
	$(VENV)/bin/python benchmarks/cpu_offload.py

clean:
	rm -rf $(VENV) build *.egg-info
