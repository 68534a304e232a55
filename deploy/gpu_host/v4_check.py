"""Does the installed GPU vLLM run a tiny DeepSeek-V4, and does pdserve's connector save its KV?

Run on the GPU host after `session.sh install` (or through `session.sh v4`). Two phases, each in a
child process so that one engine's failure or GPU memory never reaches the other:

1. engine: a tiny random-weight DeepSeek-V4 (`pdserve model tiny --arch deepseek_v4`) with
   `kv_cache_dtype="fp8_ds_mla"`, greedy tokens twice for the same prompts (must repeat), and the
   KV cache groups the engine built (spec type, block size, bytes per page, layers).
2. save: the same engine as a kv_producer on a `pdserve kvstore`, then the store's /stats (objects
   and bytes it received) and the connector's counters.

Each phase prints one line starting with "RESULT " (JSON), or the tail of its error.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request

MODEL = "/tmp/tiny-deepseek_v4"
PROMPTS = [[(7 * i + 3 * j) % 1000 + 3 for j in range(n)] for i, n in enumerate((40, 300, 1100))]


def _probe(worker) -> dict:  # runs inside the GPU worker
    cfg = worker.model_runner.kv_cache_config
    return {"num_blocks": cfg.num_blocks, "groups": [
        {"spec": type(g.kv_cache_spec).__name__, "block_size": g.kv_cache_spec.block_size,
         "page_bytes": g.kv_cache_spec.page_size_bytes, "layers": len(g.layer_names)}
        for g in cfg.kv_cache_groups]}


def engine(kv_transfer: dict | None) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    extra = {"kv_transfer_config": KVTransferConfig(**kv_transfer)} if kv_transfer else {}
    llm = LLM(model=MODEL, load_format="dummy", kv_cache_dtype="fp8_ds_mla", enforce_eager=True,
              max_model_len=4096, gpu_memory_utilization=0.3, **extra)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    runs = [[o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)]
            for _ in range(2)]
    out: dict = {"tokens_repeat": runs[0] == runs[1], "first": list(runs[0][0])}
    try:
        out["kv"] = llm.collective_rpc(_probe)[0]
    except Exception as e:  # noqa: BLE001 - the probe is a report, not the check
        out["kv"] = repr(e)
    return out


def child(phase: str) -> None:
    if phase == "engine":
        print("RESULT " + json.dumps(engine(None)), flush=True)
        return
    port, http_port = 16011, 16012
    store = subprocess.Popen(["pdserve", "kvstore", "--port", str(port), "--http-port", str(http_port),
                              "--chunk-size", "256", "--l1-size-gb", "2"])
    try:
        time.sleep(3)
        out = engine({"kv_connector": "PDServeConnector", "kv_role": "kv_producer",
                      "kv_connector_extra_config": {"kvstore_url": f"tcp://127.0.0.1:{port}"}})
        time.sleep(2)  # the producer uploads after the step that computed a chunk
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/stats", timeout=10) as r:
            out["store"] = json.loads(r.read())
        print("RESULT " + json.dumps(out), flush=True)
    finally:
        store.terminate()
        store.wait(10)


def main() -> int:
    if len(sys.argv) > 1:
        child(sys.argv[1])
        return 0
    if not os.path.isdir(MODEL):
        subprocess.run(["pdserve", "model", "tiny", "--arch", "deepseek_v4", "--out", MODEL], check=True)
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}
    failed = 0
    for phase in ("engine", "save"):
        run = subprocess.run([sys.executable, __file__, phase], capture_output=True, text=True, env=env, timeout=240)
        line = next((ln for ln in run.stdout.splitlines() if ln.startswith("RESULT ")), None)
        print(f"== {phase}: rc={run.returncode}")
        print(line or (run.stdout[-2000:] + "\n" + run.stderr[-5000:]))
        if not line:
            failed += 1
            break
    return failed


if __name__ == "__main__":
    sys.exit(main())
