# make demo: compile a small diffusers Flux transformer with fxbackend and compare it with eager.
# make test: the test suite.  Both create .venv and install what they need when it is missing.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.fxbackend-installed
# test processes (pytest-xdist): one per core, at most 4 (each holds ~1.5 GB); 0 runs serially
TEST_WORKERS ?= auto

.PHONY: demo test bench venv clean

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

test: $(STAMP)
	$(VPY) -m pytest -q -x -p no:cacheprovider -n $(TEST_WORKERS) --maxprocesses 4 \
		--dist worksteal tests

bench: $(STAMP)
	$(VPY) scripts/bench.py

clean:
	rm -rf $(VENV) build *.egg-info
