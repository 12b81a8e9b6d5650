# ddp_exp: every target installs what it needs into .venv on first use.
# torch is pinned and installed first: an unpinned torch pulls a multi-GB CUDA build.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
TORCH  ?= torch==2.13.0
TORCH_PIP_ARGS ?=
PORT   ?= 6006
ARGS   ?=
# Test worker processes (pytest-xdist). Two workers keep both cores busy: the suite takes about
# half the time of one worker on 2 cores. More cores: make test TEST_WORKERS=4. --dist loadgroup
# keeps the guide's blocks (tests/test_docs.py, xdist_group "guide") on one worker, in order: they
# build on each other, and a worker given a later block alone replays all before it. A CLI test,
# and a python -m ddp_exp of the guide (tests/zygote_shim.py), forks its run from a pre-imported
# python -m ddp_exp (tests/zygote.py; DDP_EXP_TEST_NO_ZYGOTE=1 starts real processes).
TEST_WORKERS ?= 2

# setuptools warns on every editable install of a package whose folders it maps (conf/ ships
# as ddp_exp.conf) that a folder named like the package in the working directory would shadow
# it: ten lines on a first `make run` (case U08) about a folder this project does not have.
EDITABLE_QUIET := PYTHONWARNINGS="ignore:Editable installation:UserWarning"

.PHONY: install run test test-fast test-float test-cuda sweep tensorboard bench lint clean

install: $(VENV)/.installed  ## everything: what running needs, the test and lint tools

# What running needs: torch, then ddp_exp and its dependencies (make run, sweep, tensorboard).
$(VENV)/.installed-run: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet $(TORCH_PIP_ARGS) "$(TORCH)"
	$(EDITABLE_QUIET) $(BIN)/python -m pip install --quiet -e .
	touch $@

# The test extras on top (pytest, Hydra's sweep and SLURM plugins, ruff).
$(VENV)/.installed: $(VENV)/.installed-run
	$(EDITABLE_QUIET) $(BIN)/python -m pip install --quiet -e ".[dev]"
	touch $@

run: $(VENV)/.installed-run  ## the main job: digits, MLP, 2 gloo ranks (extra overrides: make run ARGS="...")
	$(BIN)/python -m ddp_exp backend=gloo world_size=2 $(ARGS)

test: install  ## the whole suite, as CI runs it (TEST_WORKERS=2 processes)
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadgroup

test-fast: install  ## in-process tests and a smoke set of CLI runs (about 70 s)
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadgroup -m "not slow"

# Another CPU's digits on this one: ATen's kernels without AVX2/AVX512 and MKL's AVX2 ones (the
# first alone leaves MKL's matrix products bit-identical). The guide's blocks build on each other:
# one worker runs a whole file (loadfile).
FLOAT_KERNELS := ATEN_CPU_CAPABILITY=default MKL_ENABLE_INSTRUCTIONS=AVX2

test-float: install  ## the tests whose values depend on the CPU's kernels, run with another CPU's kernels
	$(FLOAT_KERNELS) $(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile -m float_sensitive

test-cuda: install  ## the CUDA/NCCL tests alone (they skip without a GPU)
	$(BIN)/python -m pytest -m cuda -rs tests/test_device.py

sweep: $(VENV)/.installed-run  ## a batch-size sweep, one world per job, under outputs/multirun/
	$(BIN)/python -m ddp_exp -m backend=gloo world_size=2 data.batch_size=16,32,64 $(ARGS)

tensorboard: $(VENV)/.installed-run  ## every run under outputs/, on http://127.0.0.1:$(PORT)
	$(BIN)/tensorboard --logdir outputs --host 127.0.0.1 --port $(PORT)

bench: $(VENV)/.installed-run  ## ddp_exp vs hand-written DDP, Lightning and a nanoGPT-style loop: benchmarks/results/, docs/benchmarks.md (ARGS="--quick" to smoke-test, ARGS="--only lm" for one group, ARGS="--list" for the groups)
	@if [ -z "$(NO_BENCH_EXTRA)" ]; then $(EDITABLE_QUIET) $(BIN)/python -m pip install --quiet -e ".[bench]" \
	  || echo "lightning did not install: its baseline is skipped"; fi
	$(BIN)/python -m benchmarks $(ARGS)

lint: install  ## ruff, and the layering of src/ddp_exp's packages (tests/test_layers.py)
	$(BIN)/ruff check src tests benchmarks examples
	$(BIN)/python -m pytest -q tests/test_layers.py

clean:
	rm -rf outputs multirun .pytest_cache .ruff_cache build dist src/*.egg-info
	find . -name __pycache__ -type d -prune -not -path "./$(VENV)/*" -exec rm -rf {} +
