# The two commands a new user runs (see README.md). Both create .venv with pinned dependencies on first use.
SHELL := /bin/bash
VENV := .venv
CONFIG ?= configs/brown_cbow_sentence_wordfreq.yaml
# Use the project's bundled NLTK data when it sits beside the checkout (CI); otherwise nltk downloads it.
ifneq ($(wildcard ../shared/nltk_data),)
export NLTK_DATA ?= $(abspath ../shared/nltk_data)
endif
export HF_DATASETS_OFFLINE ?= 1

.PHONY: setup train test test-extended lint clean cuda-dry-run
setup:
	@bash scripts/setup_env.sh

train: setup
	$(VENV)/bin/widedp train $(CONFIG)

test: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/pytest

# The multi-process cases CI leaves out (tests marked `extended`; about 10 minutes on 2 cores).
test-extended: setup
	$(VENV)/bin/pytest -m extended

# Resolve the CUDA stack (torch, fbgemm-gpu, torchrec) without installing it: works on a CPU-only machine.
cuda-dry-run:
	@bash scripts/setup_env.sh --cuda-dry-run

clean:
	rm -rf runs .cache .pytest_cache .ruff_cache
