# Two entry points for a fresh machine: `make demo` and `make test` (each sets up .venv first).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# torch first, pinned to the CPU build this workplace keeps on disk; a plain `torch>=2.5` would pull a
# multi-GB CUDA build. On a GPU host, install the torch you want into the venv before `make`.
TORCH_SPEC ?= torch==2.13.0

.PHONY: demo test setup clean-venv

$(VENV)/.ok-%: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[$*]"
	touch $@

setup: $(VENV)/.ok-convert

demo: $(VENV)/.ok-convert
	$(VENV)/bin/openinfer generate --device cpu --max-tokens 96 \
	    "What is the capital of France?" "Write a haiku about the sea."

# pytest-xdist workers (tests grouped by file, so a module's fixtures stay in one worker): the suite is sized for
# 2 cores, where one process keeps only ~1.3 busy; `make test TEST_WORKERS=0` runs it in one process
TEST_WORKERS ?= 2

test: $(VENV)/.ok-test
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

clean-venv:
	rm -rf $(VENV)
