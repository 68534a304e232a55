"""The prefill leg carries the prompt as the router's token ids (router/flow/prefill_leg.py), fast tier.

An in-process router with a local tokenizer over stub workers that record what they get, with
`--no-pd-early-prefill`, the default (tests/test_router_early_prefill.py has the other, where the
prefill leg goes before the count): a text completion's prefill leg goes as the ids the router counted (the prefill engine does not
tokenize it again), its decode leg as the client's text (the decode engine renders it itself,
which is what keeps a router tokenizer unlike the engine's from giving wrong tokens), and a
chat request's prefill leg keeps its messages.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import httpx
import msgspec
from aiohttp import web
from transformers import AutoTokenizer

from pdserve.router.app import create_app
from pdserve.router.config import RouterConfig
from worker_stubs import healthy, listening, serves_stub, worker_app

PROMPT = "The quick brown fox jumps over the lazy dog " * 20


class Recorder:
    """Stub prefill and decode workers that keep every body they get."""

    def __init__(self) -> None:
        self.prefill: list[dict[str, Any]] = []
        self.decode: list[dict[str, Any]] = []

    async def on_prefill(self, r: web.Request) -> web.Response:
        self.prefill.append(msgspec.json.decode(await r.read()))
        return web.json_response({"choices": [{"index": 0, "text": "p", "message": {"content": "p"}}]})

    async def on_decode(self, r: web.Request) -> web.Response:
        self.decode.append(msgspec.json.decode(await r.read()))
        return web.json_response({"choices": [{"index": 0, "text": "d", "message": {"content": "d"},
                                               "finish_reason": "length"}]})


async def test_prefill_leg_gets_the_routers_ids_and_decode_leg_the_text(tiny_deepseek_v3: Path) -> None:
    rec = Recorder()
    prefill_app = worker_app(healthy, serves_stub, rec.on_prefill, {"/v1/chat/completions": rec.on_prefill})
    decode_app = worker_app(healthy, serves_stub, rec.on_decode, {"/v1/chat/completions": rec.on_decode})
    async with listening(prefill_app, decode_app) as (prefill, decode):
        cfg = RouterConfig(prefill_urls=(prefill,), decode_urls=(decode,), tokenizer=str(tiny_deepseek_v3),
                           pd_min_prompt_tokens=0, pd_queue_aware=False, pd_overlap=False, health_interval=600.0,
                           pd_early_prefill=False)
        app = create_app(cfg)
        async with app.router.lifespan_context(app):
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as client:
                body = {"model": "stub", "prompt": PROMPT, "max_tokens": 2}
                deadline = time.monotonic() + 30
                # until the tokenizer has loaded (off the event loop), the stub's missing /tokenize leaves
                # the router without ids, and the prefill leg carries the text
                while True:
                    r = await client.post("/v1/completions", json=body)
                    assert r.status_code == 200, r.text
                    if isinstance(rec.prefill[-1]["prompt"], list) or time.monotonic() > deadline:
                        break
                    await asyncio.sleep(0.05)
                want = AutoTokenizer.from_pretrained(tiny_deepseek_v3).encode(PROMPT)
                assert rec.prefill[-1]["prompt"] == want
                assert rec.decode[-1]["prompt"] == PROMPT

                chat = {"model": "stub", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 2}
                r = await client.post("/v1/chat/completions", json=chat)
                assert r.status_code == 200, r.text
                assert rec.prefill[-1]["messages"] == chat["messages"] and "prompt" not in rec.prefill[-1]
