# One virtualenv, everything from PyPI. `make demo` and `make test` first install the Debian
# packages they need when missing (scripts/setup-system.sh), then create/refresh the venv.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv system-demo system-test demo test test-unit test-integration lint format bench bench-report bench-check clean

$(STAMP): pyproject.toml requirements/reward.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -r requirements/reward.txt
	$(BIN)/pip install -q -e '.[dev,reward,http]'
	# verl's own SandboxFusion client and reward code, for the compatibility tests; without its
	# dependencies (torch, ray): the tests load the files they need by path
	$(BIN)/pip install -q --no-deps 'verl==0.9.1'
	touch $(STAMP)

venv: $(STAMP)

system-demo:
	@scripts/setup-system.sh demo

system-test:
	@scripts/setup-system.sh test

# system packages strictly before the venv (python3-venv may be among them), even with -j
demo:
	@$(MAKE) --no-print-directory system-demo
	@$(MAKE) --no-print-directory venv
	$(BIN)/tangram demo

test:
	@$(MAKE) --no-print-directory system-test
	@$(MAKE) --no-print-directory venv
	$(BIN)/python -m pytest -q --durations=40 tests; rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests collected"; rc=0; fi; exit $$rc

test-unit: venv
	$(BIN)/python -m pytest -q -m unit tests

test-integration: venv
	$(BIN)/python -m pytest -q -m integration tests

lint: venv
	$(BIN)/ruff check tangram_celery scheduler reward_servers tangram_runner tests benchmarks
	$(BIN)/ruff format --check tangram_celery scheduler reward_servers tangram_runner tests benchmarks
	$(BIN)/mypy

format: venv
	$(BIN)/ruff format tangram_celery scheduler reward_servers tangram_runner tests benchmarks
	$(BIN)/ruff check --fix tangram_celery scheduler reward_servers tangram_runner tests benchmarks

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
