#!/usr/bin/env bash
# pdserve's GPU checks and figures on a CUDA host that reaches no package index.
#
# After GPU vLLM is unpacked into /tmp/site (the offline bundle's install line), from anywhere:
#
#     bash deploy/gpu_host/session.sh install tests tests-pd bench-2k
#
# Steps (each bounded, its whole log in $OUT/<step>.log, its tail printed):
#   install          pdserve beside vLLM (host_env.sh says how), tiny DeepSeek-V3 and V3.2 models
#   tests            the GPU tests of the kernels and the connector's copy path and stream order
#   tests-pd         the P/D stack tests (PDSERVE_TEST_ARCHS picks the models; default both)
#   lora             LoRA adapters' KV kept apart in the store (tests/test_connector_lora.py, tiny DeepSeek-V3)
#   bench-2k         pdserve bench serve --compare, 2k-token prompts, c=1 and 8
#   bench-2k-c1      the same at c=1 only, 24 prompts (a steadier p50 for the c=1 handoff; about 200 s)
#   bench-2k-c8      the same at c=8 only, 16 prompts
#   bench-2k-c8-48   the same with 48 prompts (six waves: the router's prefill estimate has time to learn the load)
#   bench-2k-c4-c8   the same at c=4 and c=8, 32 prompts each (issue 16's queue-aware levels; about 300 s)
#   bench-8k         the same at 8k-token prompts
#   bench-connector  pdserve bench connector at 8k and 32k tokens
#   connector-tpot   pdserve bench connector-tpot: decode TPOT with no connector, a no-op one and pdserve's, paired
#                    (P/D TPOT was x1.33 of colocated at c=1 on the H200, 2026-12-03; not yet run there)
#   v4               does this vLLM run a tiny DeepSeek-V4 (fp8_ds_mla), and does the connector save it
# ENGINE_ARGS are the benchmark engines' extra flags: default none (CUDA graphs, as users run);
# ENGINE_ARGS=--enforce-eager for the eager figures. PD_RUNS="pd-early-prefill pd" makes only those P/D runs,
# in that order (bench serve --pd-runs). GPUS: the GPUs the benchmark engines take in turn, prefill first (bench
# serve --gpus): default 0, every engine on one GPU, each with its share of the memory; GPUS=0,1 (a two-GPU host)
# puts P/D's prefill and decode engines on a GPU each, as P/D is deployed. At most 8 files come back from $OUT.
set -uo pipefail
# shellcheck source=deploy/gpu_host/host_env.sh
source "$(dirname "${BASH_SOURCE[0]}")/host_env.sh"
export ENGINE_ARGS="${ENGINE_ARGS:-}" PD_RUNS="${PD_RUNS:-}" GPUS="${GPUS:-0}"
LIMIT="${STEP_LIMIT:-540}"

bench_serve() {  # INPUT_LEN NUM_PROMPTS CONCURRENCY...
    local len=$1 prompts=$2
    shift 2
    # shellcheck disable=SC2086
    pdserve bench serve --compare --model /tmp/tiny-deepseek_v3 --input-len "$len" --output-len 128 \
        --num-prompts "$prompts" --max-concurrency "$@" --disable-tqdm --result-dir /tmp/bench-results \
        ${PD_RUNS:+--pd-runs $PD_RUNS} --gpus "$GPUS" -- \
        --load-format dummy --max-model-len 16384 --max-num-seqs 16 $ENGINE_ARGS --kv-cache-memory-bytes 8589934592
}
export -f bench_serve

GPU_TESTS=(test_gpu_connector_cache.py test_kernels_gpu.py test_kernels_cases.py test_kernels_torch.py)

status=0
for s in "$@"; do
    case "$s" in
    install) step install 120 install_pdserve ;;
    tests) step tests "$LIMIT" python3 -m pytest -q -m gpu -p no:cacheprovider "${GPU_TESTS[@]/#/$REPO/tests/}" ;;
    tests-pd) step tests-pd "$LIMIT" python3 -m pytest -v -m gpu -p no:cacheprovider "$REPO/tests/test_gpu_pd.py" ;;
    lora) step lora "$LIMIT" python3 -m pytest -v -p no:cacheprovider "$REPO/tests/test_connector_lora.py" ;;
    bench-2k) step bench-2k "$LIMIT" bench_serve 2048 16 1 8 ;;
    bench-2k-c1) step bench-2k-c1 "$LIMIT" bench_serve 2048 24 1 ;;
    bench-2k-c8) step bench-2k-c8 "$LIMIT" bench_serve 2048 16 8 ;;
    bench-2k-c8-48) step bench-2k-c8-48 "$LIMIT" bench_serve 2048 48 8 ;;
    bench-2k-c4-c8) step bench-2k-c4-c8 "$LIMIT" bench_serve 2048 32 4 8 ;;
    bench-8k) step bench-8k "$LIMIT" bench_serve 8192 16 1 8 ;;
    bench-connector)
        step bench-connector "$LIMIT" pdserve bench connector --model /tmp/tiny-deepseek_v3 --lengths 8192 32768 \
            --repeats 3 -- --kv-cache-memory-bytes 8589934592 --max-num-batched-tokens 32832 ;;
    connector-tpot)
        step connector-tpot "$LIMIT" pdserve bench connector-tpot --model /tmp/tiny-deepseek_v3 --rounds 30 -- \
            --max-model-len 4096 --kv-cache-memory-bytes 4294967296 --gpu-memory-utilization 0.2 --no-enforce-eager ;;
    v4) step v4 300 python3 "$REPO/deploy/gpu_host/v4_check.py" ;;
    *) echo "unknown step $s" >&2; false ;;
    esac || status=1
done
exit $status
