# `make serve` and `make test` set everything up on a fresh clone.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
BUF := tools/node_modules/.bin/buf
HOST ?= 127.0.0.1
PORT ?= 50051
# Two workers, each taking whole files (module-scoped servers start once): most of the
# suite waits on server processes, so two overlap on two cores; the slowest files go first
# (tests/conftest.py). Tests marked `quiet` time a bystander beside an attack (a call over
# 1.5 s is reported, over 3 s fails them; tests/reliability/attack_kit.py): they run after
# the rest, one at a time, so that the other worker's load is not what they measure.
PYTEST_WORKERS ?= 2
PYTEST_ARGS ?=
# The suite starts about 60 server processes: each would compile what the venv's import
# left uncompiled (scripts/prime_bytecode.py) if PYTHONDONTWRITEBYTECODE kept it unwritten.
TEST_ENV := env -u PYTHONDONTWRITEBYTECODE

.PHONY: all venv node-door redis-server serve test lint format proto clients buf-lint clean

all: test

$(STAMP): requirements.txt constraints.txt pyproject.toml setup.py clients/python/pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet --no-compile -r requirements.txt -c constraints.txt
	$(BIN)/python -m pip install --quiet --no-deps -e clients/python -e .
	$(BIN)/python scripts/prime_bytecode.py
	touch $(STAMP)

venv: $(STAMP)

# The Node.js gRPC door's one dependency, @grpc/grpc-js, as service/grpc/package-lock.json
# pins it. Without npm nothing is installed, and --grpc-door auto serves gRPC with grpcio.
NODE_DOOR := service/grpc/node_modules/.package-lock.json

$(NODE_DOOR): service/grpc/package.json service/grpc/package-lock.json
	@if command -v npm > /dev/null 2>&1; then \
		cd service/grpc && npm ci --omit=dev --silent --no-audit --no-fund && touch node_modules/.package-lock.json; \
	else echo "npm not found: the gRPC door will be grpcio's"; fi

node-door: $(NODE_DOOR)

# Debian's redis-server, for the result cache's Redis tests (tests/service/cache/): installed
# where it can be (root with apt-get), never failing the build; without it those tests skip.
redis-server:
	@command -v redis-server > /dev/null 2>&1 || { \
		if [ "$$(id -u)" = 0 ] && command -v apt-get > /dev/null 2>&1; then \
			DEBIAN_FRONTEND=noninteractive apt-get install -y -q redis-server > /dev/null 2>&1 \
			|| echo "redis-server not installed: the cache's Redis tests will skip"; \
		else echo "redis-server not found: the cache's Redis tests will skip"; fi; }

$(BUF): tools/package.json
	cd tools && npm install --silent --no-audit --no-fund
	touch $(BUF)

serve: $(STAMP) node-door
	$(BIN)/pooling-server --host $(HOST) --port $(PORT)

proto: $(STAMP)
	$(BIN)/python scripts/gen_proto.py

clients: $(STAMP)
	$(BIN)/python scripts/unasync_client.py

buf-lint: $(STAMP) $(BUF)
	$(BIN)/python scripts/gen_proto.py --descriptor-set $(VENV)/pooling.binpb
	$(BUF) lint $(VENV)/pooling.binpb --path pooling/v1/pooling.proto

lint: $(STAMP) buf-lint
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

test: $(STAMP) node-door redis-server lint
	$(TEST_ENV) $(BIN)/python -m pytest -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder -m "not quiet" $(PYTEST_ARGS)
	$(TEST_ENV) $(BIN)/python -m pytest tests/reliability -m quiet $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) tools/node_modules
