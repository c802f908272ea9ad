# make demo: compile a small diffusers Flux transformer with fxbackend and compare it with eager.
# make test: the test suite, then test-avx2 (the CPU-dependent tests with AVX2 vectors).
# Both create .venv and install what they need when it is missing.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.fxbackend-installed
# test processes (pytest-xdist): one per core, at most 4 (each holds ~1.5 GB); 0 runs serially
TEST_WORKERS ?= auto
# the test processes share the cores, so OpenMP threads waiting for work sleep instead of
# spinning (the spin takes the core from the other process): test_models.py and
# test_modulation.py ran in 120-122 s against 127-128 s on 2 cores; results are unchanged.
# An OMP_WAIT_POLICY set in the environment is kept
TEST_OMP_WAIT_POLICY := $(or $(TEST_OMP_WAIT_POLICY),$(OMP_WAIT_POLICY),PASSIVE)

.PHONY: demo test test-avx2 bench venv clean

$(STAMP): pyproject.toml
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	# the CPU build of torch: pinned, so that pip never pulls a multi-GB CUDA build
	$(VPY) -m pip install -q "torch==2.13.0"
	$(VPY) -m pip install -q -e ".[test]"
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(VPY) -m fxbackend demo

# the tests whose outcome depends on the CPU class, run again by test-avx2 with the vectors
# limited to AVX2 and the AVX2 class pinned (an AVX-512 host then checks the AVX2 paths too)
ISA_TESTS := tests/test_cpu_profile.py tests/test_upcast.py tests/test_quantize.py tests/test_gemm.py \
	tests/test_channels_last.py tests/test_int8.py
# numba's share of the limits: NUMBA_CPU_NAME=haswell where the host has AVX-512 (or where
# /proc/cpuinfo cannot tell).  On a host without AVX-512 numba's kernels use AVX2 vectors
# already, and naming a CPU would only key numba's disk cache anew: every kernel compiled again,
# for the same vectors (after a main run with an empty cache, test-avx2 took 139 s with it and
# 74 s without, 2 cores of an AVX2-only EPYC)
AVX2_NUMBA := $(if $(shell (grep -qsw avx512f /proc/cpuinfo || test ! -r /proc/cpuinfo) \
	&& echo yes),NUMBA_CPU_NAME=haswell)
AVX2_LIMITS := FXB_TEST_CPU_PROFILE=avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 \
	$(AVX2_NUMBA) MKL_ENABLE_INSTRUCTIONS=AVX2

test test-avx2: export OMP_WAIT_POLICY := $(TEST_OMP_WAIT_POLICY)
# no kernel compile worker processes (cpu_kernels/_workers.py) unless asked for: the test
# processes keep every core busy already (4 compile-heavy test files on 2 cores, empty kernel
# cache: 148 s without, 154 s with); tests/test_compile_workers.py starts its own
test test-avx2: export FXB_COMPILE_PROCESSES := $(or $(FXB_COMPILE_PROCESSES),0)

test: $(STAMP)
	$(VPY) -m pytest -q -x -p no:cacheprovider -n $(TEST_WORKERS) --maxprocesses 4 \
		--dist worksteal tests
	$(MAKE) --no-print-directory test-avx2

test-avx2: $(STAMP)
	$(AVX2_LIMITS) $(VPY) -m pytest -q -x -p no:cacheprovider -n $(TEST_WORKERS) \
		--maxprocesses 4 $(ISA_TESTS)

bench: $(STAMP)
	$(VPY) scripts/bench.py

clean:
	rm -rf $(VENV) build *.egg-info
