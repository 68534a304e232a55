# Sourced by the GPU host scripts beside it: the environment and the helpers they share.
#
# What a bare GPU host (no package index, GPU vLLM unpacked into /tmp/site from the offline
# bundle) needs, learnt on the H200 host:
# - run from outside the checkout: in its root `python3 -m pdserve...` finds the checkout's own
#   pdserve/ folder first, which holds only part of the package (the rest is mapped by pyproject);
# - pdserve goes into a folder of its own first: `pip install --target /tmp/site` refuses to add to
#   the bundle's /tmp/site/bin (and --upgrade would replace that folder whole);
# - the redis client is not in the image and not in vLLM's bundle: prepare the bundle with
#   EXTRA_DEPS="redis==8.1.0" (or carry its wheel), or nothing that imports the worker loads;
# - nor is redis-server: `bash deploy/gpu_host/redis_bundle.sh` here, then carry .redis-gpu/ (14 MiB)
#   with a transfer (beside .lmcache-gpu/ fits one); without it the tests run static workers;
# - `timeout` runs programs, not shell functions: steps run through `bash -c` with the functions exported.

REPO="${REPO:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}"
OUT="${OUT:-/tmp/pdserve-gpu}"
mkdir -p "$OUT"
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 VLLM_USE_FLASHINFER_SAMPLER=0
# vllm034_bundle.sh's torch 2.14 runs on the image's cuDNN 9.19 (it was built against 9.24; no model here
# runs a cuDNN kernel); with the image's own torch the versions match and this changes nothing
export PYTORCH_SKIP_CUDNN_COMPATIBILITY_CHECK=1
export PATH="/tmp/site/bin:$PATH" REPO OUT
# redis-server from deploy/gpu_host/redis_bundle.sh, when a transfer carried .redis-gpu/: kept in /tmp
# (a carried folder is gone from the checkout at the next call that does not carry it), on PATH if it runs
if [ -d "$REPO/.redis-gpu" ]; then rm -rf /tmp/redis-gpu && cp -a "$REPO/.redis-gpu" /tmp/redis-gpu; fi
if /tmp/redis-gpu/bin/redis-server --version >/dev/null 2>&1; then export PATH="/tmp/redis-gpu/bin:$PATH"; fi
cd /tmp || exit 1

# step NAME SECONDS COMMAND...: run COMMAND (a program or an exported function) under a time limit,
# its output in $OUT/NAME.log, then print the log's tail.
step() {
    local name=$1 limit=$2
    shift 2
    echo "== $name start $(date +%T)"
    timeout -k 10 "$limit" bash -c '"$@"' _ "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    echo "== $name rc=$rc end $(date +%T)"
    tail -n "${TAIL:-30}" "$OUT/$name.log"
    return $rc
}

# pdserve (this checkout) beside vLLM in /tmp/site, its `pdserve` script on PATH, and the tiny models.
install_pdserve() {
    python3 -c "import redis" 2>/dev/null || { echo "no redis module on this host (see host_env.sh)"; return 1; }
    rm -rf /tmp/pdsite
    python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/pdsite "$REPO" || return 1
    mkdir -p /tmp/site/bin && mv /tmp/pdsite/bin/pdserve /tmp/site/bin/ && rmdir /tmp/pdsite/bin || return 1
    rm -rf /tmp/site/pdserve /tmp/site/pdserve-*.dist-info && cp -a /tmp/pdsite/. /tmp/site/ || return 1
    for a in deepseek_v3 deepseek_v32; do pdserve model tiny --arch "$a" --out "/tmp/tiny-$a" >/dev/null || return 1; done
    python3 -c 'import vllm, pdserve.kvstore.connector.connector as c; print("vllm", vllm.__version__, "pdserve at", c.__file__)'
}
export -f install_pdserve
