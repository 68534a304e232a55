#!/usr/bin/env bash
# pdserve's GPU checks and figures on a CUDA host that reaches no package index.
#
# Run from the checkout's root on that host, once GPU vLLM is installed into /tmp/site
# (see ../../README.md "GPU tests" and the offline bundle's plan), naming the steps:
#
#     bash deploy/gpu_host/session.sh install tests bench-2k bench-connector
#
# Steps (each bounded by `timeout`, its whole log in $OUT/<step>.log, its tail printed):
#   install          pdserve beside vLLM in /tmp/site (no deps), tiny DeepSeek-V3 and V3.2 models
#   tests            every test marked gpu except the P/D stacks (kernels, copy path, stream order)
#   tests-pd         the P/D stack tests (PDSERVE_TEST_ARCHS picks the models; default both)
#   bench-2k         pdserve bench serve --compare, 2k-token prompts, c=1 and 8 (ENGINE_ARGS)
#   bench-8k         the same at 8k-token prompts
#   bench-connector  pdserve bench connector at 8k and 32k tokens
# ENGINE_ARGS (default: eager, as the tests run) is passed to every benchmark engine, e.g.
# ENGINE_ARGS="" for CUDA graphs. The host's logs come back only from $OUT (at most 8 files).
set -uo pipefail

OUT="${OUT:-/tmp/pdserve-gpu}"
mkdir -p "$OUT"
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 VLLM_USE_FLASHINFER_SAMPLER=0
export PATH="/tmp/site/bin:$PATH"
ENGINE_ARGS="${ENGINE_ARGS---enforce-eager}"
MEM=(--kv-cache-memory-bytes 8589934592)
LIMIT="${STEP_LIMIT:-540}"

step() {
    local name=$1
    shift
    echo "== $name start $(date +%T)"
    timeout -k 10 "$LIMIT" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    echo "== $name rc=$rc end $(date +%T)"
    tail -n "${TAIL:-30}" "$OUT/$name.log"
    return $rc
}

bench_serve() {
    local len=$1
    # shellcheck disable=SC2086
    pdserve bench serve --compare --model /tmp/tiny-deepseek_v3 --input-len "$len" --output-len 128 \
        --num-prompts 16 --max-concurrency 1 8 --disable-tqdm --result-dir /tmp/bench-results -- \
        --load-format dummy --max-model-len 16384 --max-num-seqs 16 $ENGINE_ARGS "${MEM[@]}"
}

run_step() {
    case "$1" in
    install)
        step install bash -c "python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site '$REPO' \
            && for a in deepseek_v3 deepseek_v32; do pdserve model tiny --arch \$a --out /tmp/tiny-\$a || exit 1; done \
            && python3 -c 'import vllm, pdserve.kvstore.connector.connector as c; print(\"vllm\", vllm.__version__, c.__file__)'"
        ;;
    tests)
        step tests bash -c "cd /tmp && python3 -m pytest -q -m gpu -p no:cacheprovider \
            --ignore '$REPO/tests/test_gpu_pd.py' '$REPO/tests'"
        ;;
    tests-pd)
        step tests-pd bash -c "cd /tmp && python3 -m pytest -q -m gpu -p no:cacheprovider '$REPO/tests/test_gpu_pd.py'"
        ;;
    bench-2k) step bench-2k bench_serve 2048 ;;
    bench-8k) step bench-8k bench_serve 8192 ;;
    bench-connector)
        # shellcheck disable=SC2086
        step bench-connector pdserve bench connector --model /tmp/tiny-deepseek_v3 --lengths 8192 32768 --repeats 3 -- \
            "${MEM[@]}" --max-num-batched-tokens 32832 $ENGINE_ARGS
        ;;
    *)
        echo "unknown step $1" >&2
        return 2
        ;;
    esac
}

status=0
for s in "$@"; do
    run_step "$s" || status=1
done
exit $status
