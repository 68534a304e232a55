"""A prefill worker that answers its legs but never uploads any KV: `python stub_producer.py`.

It answers every prefill leg at once with kv_transfer_params naming a real store (so a
router overlaps the next decode legs, which then wait in that store for a tail that never
comes) and answers health checks, counting them at /stats, until it is killed. That is a
producer dying between its answer and its upload, made deterministic: a real engine's
upload lands tens of ms after its answer.

It answers after ANSWER_DELAY_S, as a real prefill takes time: a router sends an overlapped
decode leg as soon as its task sees the producer picked, but an instant answer was sometimes
there first on the loaded 2-core VM (the router counted the leg under overlap_sends "answer",
built from the answer, so no leg was held); the suspicion is uvloop running the reply's I/O
callbacks before the task's wake-up.
"""

from __future__ import annotations

import argparse

import asyncio

from aiohttp import web

ANSWER_DELAY_S = 1.0


def build_app(kvstore_url: str, model: str) -> web.Application:
    counts = {"answers": 0, "health_checks": 0}

    async def health(_r: web.Request) -> web.Response:
        counts["health_checks"] += 1
        return web.Response()

    async def models(_r: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": model, "object": "model"}]})

    async def stats(_r: web.Request) -> web.Response:
        return web.json_response(counts)

    async def prefill(r: web.Request) -> web.Response:
        await r.read()
        await asyncio.sleep(ANSWER_DELAY_S)
        counts["answers"] += 1
        # what the router learns a store from; a namespace no engine uses, so no decode loads by it
        params = {"pdserve": 1, "kvstore_url": kvstore_url, "namespace": "stub-producer", "chunk_size": 256}
        return web.json_response({"object": "text_completion", "model": model, "kv_transfer_params": params,
                                  "choices": [{"index": 0, "text": "x", "finish_reason": "length"}]})

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/stats", stats)
    app.router.add_post("/v1/completions", prefill)
    return app


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--kvstore-url", required=True)
    ap.add_argument("--model", required=True)
    args = ap.parse_args()
    web.run_app(build_app(args.kvstore_url, args.model), host="127.0.0.1", port=args.port, print=None)


if __name__ == "__main__":
    main()
