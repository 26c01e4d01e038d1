# proofplane — the two commands: `make up` (demo control plane) and `make test` (whole suite).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
HOST   ?= 127.0.0.1
PORT   ?= 8470

.PHONY: setup up serve test test-deps lint contract format bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

# Control plane + demo cluster on a fresh embedded SQLite file. Ctrl-C stops it.
up: setup
	$(BIN)/proofplane up --host $(HOST) --port $(PORT)

serve: setup
	$(BIN)/proofplane serve --host $(HOST) --port $(PORT)

# Installs the Debian packages and services the tests need, then lint + the whole suite.
test: setup test-deps contract
	$(BIN)/ruff check .
	$(BIN)/pytest -n auto --dist loadfile

test-deps:
	scripts/test-deps.sh

lint: setup contract
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# The import contract (pure core imports no I/O, layers import downward, no cycles, no private
# names across modules) and mypy --strict on the pure core (the script's list of it).
contract: setup
	$(BIN)/python scripts/import_contract.py
	$(BIN)/mypy --strict $$($(BIN)/python scripts/import_contract.py --pure-paths)

format: setup
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis build dist src/*.egg-info
