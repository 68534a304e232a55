#!/usr/bin/env bash
# The LMCache backend on the GPU host: its P/D tests and the side-by-side benchmark, unattended.
#
# Run on the host (from anywhere: host_env.sh moves to /tmp), after GPU vLLM is installed in /tmp/site,
# with .lmcache-gpu/ carried beside the checkout (15 MiB; the install step merges its wheels into
# /tmp/site; deploy/gpu_host/lmcache_check.sh diagnoses a host where that fails). Build it here with
#     bash deploy/gpu_host/lmcache_wheels.sh
# (LMCache 0.5.6 compiled from its sdist against the host's torch 2.11.0+cu130: PyPI's 0.5.6 wheel
# links symbols only torch >= 2.12 exports; 0.5.3's PyPI wheel runs there as it is):
#
#     bash deploy/gpu_host/lmcache_gpu.sh install tests     # one device call each (measured on the H200
#     bash deploy/gpu_host/lmcache_gpu.sh bench-2k          # host with 0.5.6: install 63 s, tests 229 s,
#     bash deploy/gpu_host/lmcache_gpu.sh bench-tail        # bench-2k 327 s, bench-tail 216 s)
#
# Steps (each bounded by `timeout`, its whole log in $OUT/<step>.log, its tail printed):
#   install    pdserve and .lmcache-gpu's wheels into /tmp/site (no index, no deps), tiny models
#   tests      tests/test_lmcache_pd.py on tiny DeepSeek-V3 (bf16 MLA) and V3.2 (fp8_ds_mla + indexer):
#              P/D through LMCache token-identical to colocated, prefix reuse across engines,
#              conditional disaggregation from LMCache's lookup (workers in Redis when redis-server is
#              on PATH; else static workers, and the test checks the router then has no LMCache hint)
#   bench-2k   pdserve bench serve --compare --kv-backend pdserve lmcache, 2047-token prompts (7 chunks
#              of 256 + 255 tokens: pdserve's store hands the partial chunk over as a tail, the LMCache
#              decode engine recomputes it), c=1 and 8: TTFT, handoff, TPOT per backend
#   bench-tail the LMCache stack alone at 2048 tokens (chunk-aligned, nothing to recompute): bench-2k's
#              LMCache handoff minus this one's is what the partial last chunk costs on LMCache
set -uo pipefail
# shellcheck source=deploy/gpu_host/host_env.sh
source "$(dirname "${BASH_SOURCE[0]}")/host_env.sh"
export WHEELS="${LMCACHE_WHEELS:-$REPO/.lmcache-gpu}" LMCACHE_TRACK_USAGE=false DO_NOT_TRACK=1 LMCACHE_DISABLE_BANNER=1

install() {
    install_pdserve || return 1
    if ! python3 -c "import lmcache" 2>/dev/null; then  # a fresh host: merge (see lmcache_check.sh)
        rm -rf /tmp/lmcache-stage
        python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/lmcache-stage "$WHEELS"/*.whl \
            && cp -a /tmp/lmcache-stage/. /tmp/site/ && rm -rf /tmp/lmcache-stage || return 1
    fi
    python3 -c "import lmcache, vllm, pdserve.router.lmcache_view; print('lmcache', lmcache.__version__, 'vllm', vllm.__version__)"
    command -v redis-server || echo "no redis-server: the tests run the workers with static URLs"
}
export -f install

bench() {  # LENGTH BACKEND...
    local len=$1
    shift
    pdserve bench serve --compare --kv-backend "$@" --model /tmp/tiny-deepseek_v3 --input-len "$len" \
        --output-len 32 --num-prompts 8 --max-concurrency 1 8 --disable-tqdm \
        --result-dir "$OUT" --result-filename "bench-lmcache-$len.json" -- \
        --load-format dummy --max-model-len 8192 --max-num-seqs 16 --enforce-eager \
        --kv-cache-memory-bytes 4294967296 --gpu-memory-utilization 0.15
}
export -f bench

run_step() {
    case "$1" in
    install) step install 120 install ;;
    tests) step tests 420 python3 -m pytest -q -x -p no:cacheprovider "$REPO/tests/test_lmcache_pd.py" ;;
    bench-2k) step bench-2k 540 bench 2047 pdserve lmcache ;;
    bench-tail) step bench-tail 360 bench 2048 lmcache ;;
    *) echo "unknown step $1" >&2; return 2 ;;
    esac
}

status=0
for s in "${@:-install tests bench-2k bench-tail}"; do
    for one in $s; do run_step "$one" || status=1; done
done
exit $status
