#!/usr/bin/env bash
# .lmcache-gpu/: the LMCache wheels the GPU host gets (carried beside the checkout; lmcache_gpu.sh
# installs them). Run here, on a machine with nvcc (CUDA 13) and PyPI, from anywhere.
#
# LMCache's own PyPI wheel is built against the torch its release pins (0.5.6: torch 2.13), and its
# extensions link symbols older torch releases do not export (0.5.6's cuda_ops needs
# c10::NotImplementedError(SourceLocation, std::string), which torch 2.11 lacks). The host runs the
# torch GPU vLLM 0.23-0.26 pins (2.11.0+cu130), as do the seeds' fork and its users. So this builds
# LMCache's release sdist against that torch, the way LMCache documents a source build for another
# torch (`--no-build-isolation` with torch already installed): same Python code, extensions compiled
# for the host's torch. About 11 minutes on 2 cores (fresh venv, torch download, nvcc for one architecture).
#
#   LMCACHE_VERSION=0.5.6 TORCH_VERSION=2.11.0 TORCH_CUDA_ARCH_LIST=9.0 bash deploy/gpu_host/lmcache_wheels.sh
#
# TORCH_CUDA_ARCH_LIST: the GPUs the wheel will run on ("8.0;8.6;8.9;9.0" for A100, RTX 30xx/A6000,
# RTX 4090 and H100/H200; each one adds compile time). Beside the wheel: the two wheels LMCache's
# server imports that neither the host image nor the vLLM bundle has.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
LMCACHE_VERSION="${LMCACHE_VERSION:-0.5.6}"
TORCH_VERSION="${TORCH_VERSION:-2.11.0}"
PYTHON="${PYTHON:-python3.12}"  # the host's Python
BUILD_VENV="${BUILD_VENV:-/tmp/lmcache-build-venv}"
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}"
"$PYTHON" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null \
    || { echo "PYTHON=$PYTHON is not a Python 3.12 (the host's): set PYTHON to one" >&2; exit 1; }
command -v nvcc >/dev/null || { echo "nvcc not found: LMCache's CUDA extension needs the CUDA toolkit" >&2; exit 1; }
# the toolkit's root: torch takes CUDA_HOME or guesses it from nvcc's folder, wrong for a wrapper script
# such as /usr/local/bin/nvcc (then its headers are not found)
export CUDA_HOME="${CUDA_HOME:-$(dirname "$(nvcc -v /dev/null 2>&1 | sed -n 's/^#\$ _HERE_=//p' | head -1)")}"

if ! "$BUILD_VENV/bin/python" -c "import torch; assert torch.__version__.startswith('$TORCH_VERSION')" 2>/dev/null; then
    "$PYTHON" -m venv "$BUILD_VENV"
    # the CUDA build of torch with its nvidia packages: importing torch (the build does) needs them
    "$BUILD_VENV/bin/pip" install -q "torch==$TORCH_VERSION"
fi
# LMCache's build requirements (its pyproject) less torch, which stays the one installed above
"$BUILD_VENV/bin/pip" install -q ninja "packaging>=24.2" "setuptools>=77.0.3,<81" "setuptools_scm>=8" \
    grpcio==1.78.0 grpcio-tools==1.78.0 wheel numpy
# torch's CUDA headers include the CUDA libraries' headers (cusparse.h, cublas_v2.h ...); the nvidia
# packages torch installed carry them, a bare nvcc install may not
nvinc="$("$BUILD_VENV/bin/python" -c 'import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], "cu13", "include"))')"
mkdir -p .lmcache-gpu
rm -f .lmcache-gpu/lmcache-*.whl
PATH="$CUDA_HOME/bin:$BUILD_VENV/bin:$PATH" CPATH="$nvinc${CPATH:+:$CPATH}" BUILD_WITH_CUDA=1 MAX_JOBS="${MAX_JOBS:-2}" \
    "$BUILD_VENV/bin/pip" wheel -q --no-deps --no-build-isolation --no-binary lmcache -w .lmcache-gpu \
    "lmcache==$LMCACHE_VERSION"
"$BUILD_VENV/bin/pip" download -q -d .lmcache-gpu --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 opentelemetry-exporter-prometheus==0.61b0 sortedcontainers==2.4.0
# the extension must link against this torch: load it (no GPU needed to resolve its symbols)
"$BUILD_VENV/bin/pip" install -q --no-deps --force-reinstall .lmcache-gpu/lmcache-*.whl
"$BUILD_VENV/bin/python" -c "import torch, lmcache.cuda_ops; print('lmcache.cuda_ops loads beside torch', torch.__version__)"
ls -la .lmcache-gpu
