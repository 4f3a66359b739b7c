"""`npu-pool submit` and `npu-pool status`."""

from __future__ import annotations

import argparse
import json
import sys

from rich.console import Console

from producer.client import Client, QueueFull
from producer.status import collect_status
from producer.status_view import render, watch


def submit_main(argv: list[str]) -> int:
    """Submit one prompt; print the completion, or stream it as it is generated."""
    parser = argparse.ArgumentParser(prog="npu-pool submit", description=submit_main.__doc__)
    parser.add_argument("prompt")
    parser.add_argument(
        "--chat", action="store_true", help="send the prompt as a user message (chat template)"
    )
    parser.add_argument("--system", default=None, help="with --chat: a system message first")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--id", dest="request_id", default=None, help="request id to use")
    parser.add_argument("--stream", action="store_true", help="print text as it arrives")
    parser.add_argument("--json", action="store_true", help="print the Completion as JSON")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds to wait")
    parser.add_argument("--redis-url", default=None)
    parser.add_argument("--namespace", default=None)
    args = parser.parse_args(argv)
    if args.system is not None and not args.chat:
        parser.error("--system needs --chat")
    messages = None
    if args.chat:
        system = [{"role": "system", "content": args.system}] if args.system is not None else []
        messages = system + [{"role": "user", "content": args.prompt}]
    try:
        client = Client(args.redis_url, args.namespace)
        request_id = client.submit(
            None if args.chat else args.prompt,
            messages=messages,
            request_id=args.request_id,
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            seed=args.seed,
        )
    except (QueueFull, ConnectionError, ValueError) as exc:
        print(f"npu-pool submit: {exc}", file=sys.stderr)
        return 1
    if args.stream:
        final = None
        for chunk in client.stream(request_id, timeout_s=args.timeout):
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
            final = chunk
        print()
        if final is not None and final.error is not None:
            print(f"[{final.finish_reason}] {final.error.message}", file=sys.stderr)
        return 0 if final is not None and final.error is None else 1
    completion = client.result(request_id, timeout_s=args.timeout)
    if args.json:
        print(completion.model_dump_json())
    else:
        print(completion.text)
        if completion.error is not None:
            print(f"[{completion.finish_reason}] {completion.error.message}", file=sys.stderr)
    return 0 if completion.error is None else 1


def cancel_main(argv: list[str]) -> int:
    """Cancel requests: queued ones end at once, running ones by the next step."""
    parser = argparse.ArgumentParser(prog="npu-pool cancel", description=cancel_main.__doc__)
    parser.add_argument("request_ids", nargs="+", metavar="ID")
    parser.add_argument("--redis-url", default=None)
    parser.add_argument("--namespace", default=None)
    args = parser.parse_args(argv)
    try:
        client = Client(args.redis_url, args.namespace)
    except ConnectionError as exc:
        print(f"npu-pool cancel: {exc}", file=sys.stderr)
        return 1
    for request_id in args.request_ids:
        client.cancel(request_id)
        print(f"cancel requested: {request_id}")
    return 0


def status_main(argv: list[str]) -> int:
    """Show pools, ranks (pid, host, device, state) and the queue."""
    parser = argparse.ArgumentParser(prog="npu-pool status", description=status_main.__doc__)
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument("--watch", action="store_true", help="a live view, until Ctrl-C")
    parser.add_argument("--interval", type=float, default=1.0, help="--watch refresh, s")
    parser.add_argument("--redis-url", default=None)
    parser.add_argument("--namespace", default=None)
    args = parser.parse_args(argv)
    try:
        client = Client(args.redis_url, args.namespace)
        status = collect_status(client.redis, client.keys)
    except ConnectionError as exc:
        print(f"npu-pool status: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(status, indent=2))
        return 0
    if args.watch:
        watch(client.redis, client.keys, args.interval)
        return 0
    Console().print(render(status))
    return 0
