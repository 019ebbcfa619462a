# First run of `make demo` or `make test` creates .venv and installs what it needs.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast clean

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PY) -m venv $(VENV) || python3 -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch==2.13.0 first: on the CPU machines it is a local CPU build; never a CUDA download.
	$(BIN)/python -m pip install -q "torch==2.13.0"
	$(BIN)/python -m pip install -q "transformers>=5.17,<6" "safetensors>=0.4" "tqdm>=4.60" "pytest>=8" "megatron-core==0.16.1" "peft>=0.17"
	$(BIN)/python -m pip install -q --no-deps -e .
	@touch $(STAMP)

demo: $(STAMP)
	$(BIN)/actorcore demo

test: $(STAMP)
	$(BIN)/python -m pytest -q tests

# The unit tier: tests/unit, one CPU process (the folder is the tier: tests/conftest.py marks it `unit`).
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q tests/unit

clean:
	rm -rf $(VENV)
