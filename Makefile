# Development environment: CPU torch pinned (a plain "torch" would pull a multi-GB CUDA build).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install -q --disable-pip-version-check
TORCH_PIN := torch==2.13.0

.PHONY: install test test-all test-floor test-gpu gpu-report gpu-wheels demo clean

# The package with its train extra (what the demo needs: corpus, plots, progress bar), then the
# dev extra on top (what the tests need; it includes train and bench).
$(VENV)/.base: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) --upgrade pip
	$(PIP) "$(TORCH_PIN)"
	$(PIP) -e ".[train]" "$(TORCH_PIN)"
	touch $@

$(VENV)/.dev: $(VENV)/.base
	$(PIP) -e ".[dev]" "$(TORCH_PIN)"
	touch $@

install: $(VENV)/.dev

# Wall time never fails a run (machines of one kind differ 2x): pytest prints the run's time and
# its 15 slowest tests; pytest-timeout's per-test limit (pyproject.toml) only guards against hangs.
test: $(VENV)/.dev
	$(PY) -m pytest -q -m "not slow and not gpu" -p no:cacheprovider --durations=15

test-all: $(VENV)/.dev
	$(PY) -m pytest -q -p no:cacheprovider

# The oldest torch the package accepts (pyproject: torch>=2.11), on the tests of the code that reads
# FSDP2's private state or calls its newer API (qsdp/_fsdp2.py and its users). PyPI has no CPU build
# of torch 2.11 for Linux: this takes its CUDA build (about 4.6 GB in .venv-floor), which runs on a
# CPU; not part of `make test`.
FLOOR_TORCH := torch==2.11.0
FLOOR_TESTS := tests/test_fsdp2_internals.py tests/test_glue_guards.py tests/test_hsdp.py \
	tests/test_native_hsdp.py tests/test_tp_replicas.py
.venv-floor/.installed: pyproject.toml
	test -x .venv-floor/bin/python || $(PYTHON) -m venv .venv-floor
	.venv-floor/bin/python -m pip install -q --disable-pip-version-check "$(FLOOR_TORCH)" numpy pytest pytest-timeout hypothesis
	.venv-floor/bin/python -m pip install -q --disable-pip-version-check --no-deps -e .
	touch $@

test-floor: .venv-floor/.installed
	.venv-floor/bin/python -m pytest -q -m "not slow and not gpu" -p no:cacheprovider $(FLOOR_TESTS)

# On a CUDA machine where torch, triton and pytest are already installed and no package registry
# is reachable: this checkout installed into that Python as it is (no extras: the smoke needs
# none), then the gpu tests (skips listed), `qsdp bench kernels|codecs --json` and 4 ranks sharing
# the GPU per preset on the sample text shipped in the package, Triton vs reference; a line as
# each part ends.
GPU_PYTHON ?= python3
GPU_OUT ?= $(if $(OUT),$(OUT),benchmarks/results/gpu)
test-gpu:
	$(GPU_PYTHON) -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
	$(GPU_PYTHON) -m qsdp.bench.gpu_smoke --out "$(GPU_OUT)"

# Every GPU measurement on such a machine, stage by stage in priority order (test-gpu, codec-share,
# kernels, train-gpu, train-gpu-4bit, gloo-step, cluster), each within its printed budget (5 minutes
# at most, 25 in all; every line a stage prints is shown as it comes),
# into $(GPU_OUT)/<device>-<commit>/. Each stage's record keeps the commit and a hash of the files
# it measures: its result stays valid until they change. STAGES=next: only the stages with no
# valid result in benchmarks/results/gpu (missing or stale). STAGES="kernels cluster": those
# stages, added to that folder. BUDGET=540: this command's seconds; a stage starts only while its
# budget fits in what is left, the others wait for a later run. WHEELS=DIR: pyroute2 for the
# sweep from a wheel there (`make gpu-wheels WHEELS=DIR` writes it where pyroute2 is installed).
# COMMIT=abc1234: the commit in a copy without .git. DRY_RUN=1: each stage's newest valid result
# or why it is due, and what would run with its budget and commands (no GPU needed; the
# development environment's Python where there is one).
GPU_STAGES = $(filter-out next,$(STAGES))
GPU_REPORT_ARGS = --out "$(GPU_OUT)" $(if $(filter next,$(STAGES)),--next) $(if $(GPU_STAGES),--only $(GPU_STAGES)) \
	$(if $(BUDGET),--budget $(BUDGET)) $(if $(WHEELS),--wheels "$(WHEELS)") $(if $(COMMIT),--commit $(COMMIT))
gpu-report:
ifdef DRY_RUN
	$(if $(wildcard $(PY)),$(PY),$(GPU_PYTHON)) -m benchmarks.gpu_report --dry-run $(GPU_REPORT_ARGS)
else
	$(GPU_PYTHON) -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
	$(GPU_PYTHON) -m benchmarks.gpu_report $(GPU_REPORT_ARGS)
endif

gpu-wheels: $(VENV)/.dev
	$(if $(WHEELS),,$(error gpu-wheels writes into WHEELS=DIR; name the folder))
	$(PY) -m benchmarks.gpu_report --pack-wheels "$(WHEELS)"

demo: $(VENV)/.base
	$(VENV)/bin/qsdp demo

clean:
	rm -rf $(VENV) build src/*.egg-info
