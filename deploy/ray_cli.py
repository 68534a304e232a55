"""`pdserve ray status|down`: look at or remove a pdserve stack that runs on a Ray cluster.

The stack is whatever `python -m pdserve.deploy.ray_app` left in its Ray namespace:
named, detached actors (one per service) and the placement groups of the workers.
Both commands join the cluster as a short-lived driver in that namespace, so they work
from any machine that can reach it, long after the job that started the stack ended.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Sequence

STATUS_TIMEOUT_S = 10.0
COLUMNS = ("name", "kind", "node_ip", "url", "pid", "alive", "ready", "gpus")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve ray", description="Status and teardown of a pdserve stack on Ray.")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--address", default=None,
                        help="Ray cluster address, e.g. 10.0.0.1:6379 (default: $RAY_ADDRESS, else auto)")
    common.add_argument("--namespace", default="pdserve", help="the stack's name (`name` in the cluster config)")
    sub = p.add_subparsers(dest="action", required=True)
    status = sub.add_parser("status", parents=[common], help="list the stack's services and whether they are ready")
    status.add_argument("--json", action="store_true", help="one JSON object per service instead of a table")
    down = sub.add_parser("down", parents=[common], help="stop every service and remove its actors and reservations")
    down.add_argument("--timeout", type=float, default=120.0,
                      help="seconds each service gets to stop (workers drain) before it is killed")
    return p


def collect_status(namespace: str) -> list[dict[str, Any]]:
    """One dict per actor of the stack; an actor that does not answer is reported as unreachable."""
    import ray

    from pdserve.deploy.ray_app import stack_actors

    rows = []
    for name, actor in stack_actors(namespace).items():
        try:
            rows.append(ray.get(actor.status.remote(), timeout=STATUS_TIMEOUT_S))
        except (ray.exceptions.RayError, TimeoutError) as exc:
            rows.append({"name": name, "alive": False, "ready": False, "error": type(exc).__name__})
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    cells = [list(COLUMNS)] + [[str(r.get(c, "-")) for c in COLUMNS] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(COLUMNS))]
    return "\n".join("  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip() for row in cells)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    from pdserve.deploy.ray_app import connect

    connect(args.address, args.namespace, log_to_driver=False)
    if args.action == "status":
        rows = collect_status(args.namespace)
        if args.json:
            for row in rows:
                print(json.dumps(row))
        elif rows:
            print(format_table(rows))
        else:
            print(f"no pdserve stack in namespace {args.namespace!r}")
        return 0 if rows and all(r.get("ready") for r in rows) else 1
    from pdserve.deploy.ray_app import teardown

    removed = teardown(args.namespace, timeout_s=args.timeout)
    print(f"removed {', '.join(removed)}" if removed else f"no pdserve stack in namespace {args.namespace!r}")
    return 0
