"""The router's whole configuration in one typed place, and the CLI that fills it.

Flag names follow what vLLM users already type (`--host`, `--port`, `--api-key`,
`--model`); the P/D-specific ones follow vLLM's disaggregation proxies
(`--prefill URL...`, `--decode URL...`). Other services (pdserve up, tests) start
the router through these flags, so they are a stable interface.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Literal, Sequence, get_args

from pdserve.kvstore.client.auth import add_client_token_flag

PolicyName = Literal["least-loaded", "round-robin", "prefix-aware"]
POLICIES: tuple[str, ...] = get_args(PolicyName)


@dataclass(frozen=True)
class RouterConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    prefill_urls: tuple[str, ...] = ()
    decode_urls: tuple[str, ...] = ()
    redis_url: str | None = None
    model: str | None = None  # only follow Redis workers that serve this model
    tokenizer: str | None = None  # local tokenizer path; default: the served model name when it is a folder
    prefill_policy: PolicyName = "least-loaded"
    decode_policy: PolicyName = "least-loaded"
    pd_min_prompt_tokens: int = 256
    pd_max_cached_fraction: float = 0.5  # prompts this much in the store already skip the prefill leg
    pd_overlap: bool = True  # send the decode leg with the prefill leg (it waits in the store for the KV)
    # when an overlapped decode leg goes out: "estimate" (at the prefill's predicted end less the decode
    # ingest, once both are measured), or "start" (with the prefill leg, where a held leg costs nothing)
    pd_overlap_send: Literal["estimate", "start"] = "estimate"
    # stream the prefill leg's token as the first one and send the decode leg the prompt plus it (the legs in
    # sequence), for the streamed completions that one sampled token can be handed over without changing
    # what the request means (first_token.py); the others take the overlapped flow. On by default: an
    # overlapped decode leg starts its KV load only once the prefill has ended too, so overlapping hides
    # only the decode leg's ingest, while the handed token skips the load and a decode step (H200 runs:
    # P/D TTFT p50 4.6-5.2 ms over colocated at c=1 against 21.7-25.8 overlapped; lower than the
    # overlapped flow's at c=4 and c=8 in every run)
    pd_first_token: bool = True
    # send the prefill leg before the router has counted the prompt's tokens, when its body is sure to be long
    # enough and it is not likely stored; the count runs beside the leg, and finding the prompt short after
    # all cancels the leg (paths.py). Off by default: it takes the count out of the router's time, but on an
    # H100 (2k tokens, two runs) P/D TTFT p50 was 58.3/62.4 ms with it against 49.2/46.4 without at c=4, and
    # mixed at c=8 (70.1/60.6 against 64.2/68.6); on the 2-core VM no clear difference either
    pd_early_prefill: bool = False
    pd_queue_aware: bool = True  # decode-only when the prefill queue would delay a prompt more than recomputing it
    pd_queue_poll_interval: float = 0.5  # seconds between scrapes of each worker's /metrics (its queue)
    api_key: str | None = None
    kvstore_auth_token: str | None = None  # for the router's prefix lookups and tail drops
    max_inflight_per_worker: int = 64
    max_queue: int = 256
    queue_timeout: float = 30.0
    retry_after_s: int = 1
    prefill_timeout: float = 300.0
    # a worker silent this long on every leg it owes bytes (and, before any of them runs, STALL_FACTOR times
    # what its oldest leg's prompt could take going by the pool's recent legs) is stalled: out of the pool until a canary is answered, its legs
    # moved on (stall_watch.py); 0 turns a pool's watch off. Decode waits longer: a KV load comes first
    prefill_stall_timeout: float = 10.0
    decode_stall_timeout: float = 30.0
    decode_timeout: float = 600.0
    connect_timeout: float = 5.0
    health_interval: float = 2.0
    health_failures: int = 2  # routine health checks failed in a row (not a refused connection) that take a worker out
    breaker_failures: int = 3
    breaker_cooldown: float = 5.0
    max_request_bytes: int = 16 << 20
    max_header_bytes: int = 64 << 10  # a request's URL and headers together, or its trailers (nginx: 4 x 8 KiB)
    header_timeout: float = 30.0  # seconds for a client to send a request's head (request line and headers)
    body_timeout: float = 60.0  # seconds for a client to send its whole request body
    send_timeout: float = 60.0  # seconds a client may take no byte of its answer before its connection is cut
    log_level: str = "info"

    def __post_init__(self) -> None:
        for url in (*self.prefill_urls, *self.decode_urls):
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"worker URL must start with http:// or https://, got {url!r}")
        if not self.decode_urls and not self.redis_url:
            raise ValueError("no decode workers: give --decode URL... or --redis-url for discovery")
        for name in ("prefill_policy", "decode_policy"):
            if getattr(self, name) not in POLICIES:
                raise ValueError(f"{name} must be one of {POLICIES}, got {getattr(self, name)!r}")
        positive = ("max_inflight_per_worker", "prefill_timeout", "decode_timeout", "connect_timeout",
                    "health_interval", "health_failures", "breaker_failures", "max_request_bytes", "max_header_bytes",
                    "queue_timeout", "header_timeout", "body_timeout", "send_timeout", "pd_queue_poll_interval")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        nonnegative = ("max_queue", "pd_min_prompt_tokens", "prefill_stall_timeout", "decode_stall_timeout")
        for name in nonnegative:
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must not be negative, got {getattr(self, name)}")
        if not 0.0 < self.pd_max_cached_fraction <= 1.0:
            raise ValueError(f"pd_max_cached_fraction must be in (0, 1], got {self.pd_max_cached_fraction}")


def build_parser() -> argparse.ArgumentParser:
    d = RouterConfig.__dataclass_fields__
    p = argparse.ArgumentParser(
        prog="pdserve router",
        description="OpenAI-compatible router: prefill on a prefill worker, decode (streamed) on a decode worker.",
    )
    p.add_argument("--host", default=d["host"].default)
    p.add_argument("--port", type=int, default=d["port"].default)
    p.add_argument("--prefill", nargs="+", default=[], metavar="URL", help="static prefill worker base URLs")
    p.add_argument("--decode", nargs="+", default=[], metavar="URL", help="static decode worker base URLs")
    p.add_argument("--redis-url", default=None, help="follow workers registered in Redis (e.g. redis://host:6379/0)")
    p.add_argument("--model", default=None, help="only use Redis workers serving this model name")
    p.add_argument("--tokenizer", default=None, help="tokenizer folder for prompt token counting")
    for leg in ("prefill", "decode"):
        p.add_argument(f"--{leg}-policy", choices=POLICIES, default="least-loaded")
    p.add_argument("--pd-min-prompt-tokens", type=int, default=d["pd_min_prompt_tokens"].default,
                   help="shorter prompts skip the prefill leg: the decode worker prefills locally")
    p.add_argument("--pd-max-cached-fraction", type=float, default=d["pd_max_cached_fraction"].default,
                   help="prompts whose prefix is at least this fraction in the KV store skip the prefill leg")
    p.add_argument("--pd-overlap", action=argparse.BooleanOptionalAction, default=d["pd_overlap"].default,
                   help="send the decode leg at the same time as the prefill leg (its KV load waits in the "
                        "store for the prefill's upload); --no-pd-overlap sends it after the prefill answers")
    p.add_argument("--pd-overlap-send", choices=("estimate", "start"), default=d["pd_overlap_send"].default,
                   help="when an overlapped decode leg goes out: at the prefill's predicted end less the decode "
                        "engine's ingest (estimate; a held leg keeps vLLM's CPU engines stepping), or with the "
                        "prefill leg (start)")
    p.add_argument("--pd-first-token", action=argparse.BooleanOptionalAction, default=d["pd_first_token"].default,
                   help="stream the token the prefill leg generated as the first one, then the decode leg's "
                        "(sent the prompt plus that token): P/D TTFT becomes the prefill's, the decode leg's "
                        "time moves to the second token; streamed completions without logprobs, stop strings, "
                        "penalties, seeds or structured output only, the rest as without it; "
                        "--no-pd-first-token sends them the way --pd-overlap says, as the rest")
    p.add_argument("--pd-early-prefill", action=argparse.BooleanOptionalAction,
                   default=d["pd_early_prefill"].default,
                   help="send the prefill leg while the router counts a long prompt's tokens (one not likely "
                        "stored); a count under --pd-min-prompt-tokens cancels the leg")
    p.add_argument("--pd-queue-aware", action=argparse.BooleanOptionalAction, default=d["pd_queue_aware"].default,
                   help="send a prompt decode-only when the prefill workers' queue would delay it more than "
                        "recomputing it on a decode worker costs (both measured from finished requests)")
    p.add_argument("--pd-queue-poll-interval", type=float, default=d["pd_queue_poll_interval"].default,
                   help="seconds between scrapes of each worker's /metrics for its queue; snapshots older than "
                        "twice this are ignored")
    p.add_argument("--api-key", default=None, help="Bearer key clients must send; also sent to workers")
    add_client_token_flag(p, "for prefix lookups and tail drops")
    p.add_argument("--max-inflight-per-worker", type=int, default=d["max_inflight_per_worker"].default)
    p.add_argument("--max-queue", type=int, default=d["max_queue"].default,
                   help="requests that may wait for a free worker; beyond it: 429")
    p.add_argument("--queue-timeout", type=float, default=d["queue_timeout"].default,
                   help="seconds a queued request waits before 429")
    p.add_argument("--prefill-timeout", type=float, default=d["prefill_timeout"].default)
    for leg in ("prefill", "decode"):
        p.add_argument(f"--{leg}-stall-timeout", type=float, default=d[f"{leg}_stall_timeout"].default,
                       help=f"a {leg} worker silent this many seconds on every request it owes bytes (and, "
                            "before any of them streams, 4x what its oldest prompt could take going by the "
                            "pool's recent requests) leaves the pool until a canary request is answered; its requests move on "
                            "(0: off)")
    p.add_argument("--decode-timeout", type=float, default=d["decode_timeout"].default,
                   help="seconds without a byte from the decode worker before the leg fails")
    p.add_argument("--health-interval", type=float, default=d["health_interval"].default)
    p.add_argument("--health-failures", type=int, default=d["health_failures"].default,
                   help="health checks failed in a row (timed out, reset, not 200) that take a worker out of the "
                        "pool; one whose port refuses connections, or that a failed request made suspect, goes at once")
    p.add_argument("--breaker-failures", type=int, default=d["breaker_failures"].default,
                   help="consecutive failures that open a worker's circuit breaker")
    p.add_argument("--breaker-cooldown", type=float, default=d["breaker_cooldown"].default)
    p.add_argument("--max-request-bytes", type=int, default=d["max_request_bytes"].default,
                   help="larger request bodies get 413")
    p.add_argument("--max-header-bytes", type=int, default=d["max_header_bytes"].default,
                   help="a request head (URL and headers), or a chunked body's trailers, larger than this gets 431 "
                        "and its connection closed")
    p.add_argument("--header-timeout", type=float, default=d["header_timeout"].default,
                   help="seconds a client has to send a request's head; slower connections are closed")
    p.add_argument("--body-timeout", type=float, default=d["body_timeout"].default,
                   help="seconds a client has to send its whole request body; slower ones get 408")
    p.add_argument("--send-timeout", type=float, default=d["send_timeout"].default,
                   help="seconds a client may take no byte of its answer (as nginx's send_timeout); then its "
                        "connection is cut and the request's worker slot freed")
    p.add_argument("--log-level", default=d["log_level"].default, type=str.lower,
                   choices=["debug", "info", "warning", "error"])
    return p


def config_from_args(argv: Sequence[str]) -> RouterConfig:
    """Parse argv into a RouterConfig; a bad combination exits with the parser's usage error."""
    parser = build_parser()
    a = parser.parse_args(list(argv))
    try:
        return RouterConfig(
            host=a.host,
            port=a.port,
            prefill_urls=tuple(u.rstrip("/") for u in a.prefill),
            decode_urls=tuple(u.rstrip("/") for u in a.decode),
            redis_url=a.redis_url,
            model=a.model,
            tokenizer=a.tokenizer,
            prefill_policy=a.prefill_policy,
            decode_policy=a.decode_policy,
            pd_min_prompt_tokens=a.pd_min_prompt_tokens,
            pd_max_cached_fraction=a.pd_max_cached_fraction,
            pd_overlap=a.pd_overlap,
            pd_overlap_send=a.pd_overlap_send,
            pd_first_token=a.pd_first_token,
            pd_early_prefill=a.pd_early_prefill,
            pd_queue_aware=a.pd_queue_aware,
            pd_queue_poll_interval=a.pd_queue_poll_interval,
            api_key=a.api_key,
            kvstore_auth_token=a.kvstore_auth_token,
            max_inflight_per_worker=a.max_inflight_per_worker,
            max_queue=a.max_queue,
            queue_timeout=a.queue_timeout,
            prefill_timeout=a.prefill_timeout,
            prefill_stall_timeout=a.prefill_stall_timeout,
            decode_stall_timeout=a.decode_stall_timeout,
            decode_timeout=a.decode_timeout,
            health_interval=a.health_interval,
            health_failures=a.health_failures,
            breaker_failures=a.breaker_failures,
            breaker_cooldown=a.breaker_cooldown,
            max_request_bytes=a.max_request_bytes,
            max_header_bytes=a.max_header_bytes,
            header_timeout=a.header_timeout,
            body_timeout=a.body_timeout,
            send_timeout=a.send_timeout,
            log_level=a.log_level,
        )
    except ValueError as exc:
        parser.error(str(exc))  # exits with status 2 and the usage line
