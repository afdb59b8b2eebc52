# One virtualenv, everything from PyPI. `make demo` and `make test` create/refresh it.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv demo test test-unit test-integration lint format bench bench-report bench-check clean

$(STAMP): pyproject.toml requirements/reward.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -r requirements/reward.txt
	$(BIN)/pip install -q -e '.[dev,reward]'
	touch $(STAMP)

venv: $(STAMP)

demo: venv
	$(BIN)/tangram demo

test: venv
	$(BIN)/python -m pytest -q tests; rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests collected"; rc=0; fi; exit $$rc

test-unit: venv
	$(BIN)/python -m pytest -q -m unit tests

test-integration: venv
	$(BIN)/python -m pytest -q -m integration tests

lint: venv
	$(BIN)/ruff check tangram_celery scheduler reward_servers tests benchmarks
	$(BIN)/ruff format --check tangram_celery scheduler reward_servers tests benchmarks
	$(BIN)/mypy

format: venv
	$(BIN)/ruff format tangram_celery scheduler reward_servers tests benchmarks
	$(BIN)/ruff check --fix tangram_celery scheduler reward_servers tests benchmarks

bench: venv
	$(BIN)/python benchmarks/overhead.py

# Rewrite every figure quoted in README.md and docs/*.md from benchmarks/results/*.json; fails
# on a figure without a source (benchmarks/report.py). bench-check changes nothing.
bench-report: venv
	$(BIN)/python benchmarks/report.py

bench-check: venv
	$(BIN)/python benchmarks/report.py --check

clean:
	rm -rf $(VENV) .tangram build *.egg-info
