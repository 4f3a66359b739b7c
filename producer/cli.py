"""`npu-pool submit`, `npu-pool cancel` and `npu-pool status`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import redis
from pydantic import ValidationError
from rich.console import Console

from producer.client import Client, QueueFull
from producer.lookup import find_request
from producer.requests import invalid_reason
from producer.status import collect_status
from producer.status_view import render, watch
from schemas.connection import redacted_url

CONNECTION_HELP = (
    "default: REDIS_URL, else the running `npu-pool up` (`npu-pool status --url` prints it)"
)
# Request fields as `submit` names them, for one-line errors about bad values.
SUBMIT_FLAGS = {
    "max_tokens": "--max-tokens",
    "temperature": "--temperature",
    "top_p": "--top-p",
    "seed": "--seed",
    "id": "--id",
    "tenant": "--tenant",
    "prompt": "PROMPT",
}


def add_connection_flags(parser: argparse.ArgumentParser) -> None:
    """`--redis-url` and `--namespace`, as every producer command takes them."""
    parser.add_argument("--redis-url", default=None, help=CONNECTION_HELP)
    parser.add_argument(
        "--namespace", default=None, help="prefix of the pool's Redis keys (default: npupool)"
    )


def submit_parser() -> argparse.ArgumentParser:
    """The flags of `npu-pool submit`."""
    parser = argparse.ArgumentParser(
        prog="npu-pool submit",
        description="Submit one prompt; print the completion, or stream it as it is generated. "
        "The request id goes to stderr first (stdout with --no-wait), for `npu-pool cancel`.",
    )
    parser.add_argument("prompt", metavar="PROMPT", help="the prompt text")
    parser.add_argument(
        "--chat", action="store_true", help="send the prompt as a user message (chat template)"
    )
    parser.add_argument("--system", default=None, help="with --chat: a system message first")
    parser.add_argument(
        "--max-tokens", type=int, default=64, help="most tokens to generate (default: 64)"
    )
    parser.add_argument(
        "--temperature", type=float, default=0.0, help="0 is greedy (default); higher: more random"
    )
    parser.add_argument(
        "--top-p",
        type=float,
        default=1.0,
        help="nucleus sampling: keep this much probability mass (default: 1, all)",
    )
    parser.add_argument(
        "--seed", type=int, default=None, help="seed of the random draws: same seed, same text"
    )
    parser.add_argument(
        "--id",
        dest="request_id",
        default=None,
        help="request id to use (default: generated); an id whose result is kept is not run twice",
    )
    parser.add_argument("--stream", action="store_true", help="print text as it arrives")
    parser.add_argument(
        "--no-wait", action="store_true", help="print the request id and exit at once"
    )
    parser.add_argument("--json", action="store_true", help="print the Completion as JSON")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds to wait")
    parser.add_argument(
        "--tenant", default=None, help="the tenant to queue it for (default: default)"
    )
    shape = parser.add_mutually_exclusive_group()
    shape.add_argument(
        "--json-schema",
        metavar="FILE",
        default=None,
        help="the text must be JSON valid against the JSON schema in FILE ('-': stdin)",
    )
    shape.add_argument("--json-object", action="store_true", help="the text must be a JSON object")
    shape.add_argument("--regex", default=None, help="the text must match this regular expression")
    shape.add_argument(
        "--choice", action="append", default=None, help="the text must be one of these (repeat)"
    )
    shape.add_argument(
        "--grammar",
        metavar="FILE",
        default=None,
        help="the text must match the Lark grammar in FILE",
    )
    add_connection_flags(parser)
    return parser


def _constraint(args: argparse.Namespace) -> dict[str, Any] | None:
    """The constraint the flags ask for; ValueError for a file that cannot be read."""

    def read(path: str) -> str:
        try:
            return sys.stdin.read() if path == "-" else Path(path).read_text()
        except OSError as exc:
            raise ValueError(f"cannot read {path}: {exc.strerror}") from exc

    if args.json_schema is not None:
        try:
            schema = json.loads(read(args.json_schema))
        except json.JSONDecodeError as exc:
            raise ValueError(f"--json-schema {args.json_schema}: not JSON: {exc}") from exc
        return {"type": "json_schema", "json_schema": schema, "strict": True}
    if args.json_object:
        return {"type": "json_object"}
    if args.regex is not None:
        return {"type": "regex", "pattern": args.regex}
    if args.choice:
        return {"type": "choice", "choices": args.choice}
    if args.grammar is not None:
        return {"type": "grammar", "grammar": read(args.grammar)}
    return None


def submit_main(argv: list[str]) -> int:
    """Submit one prompt; print the completion, or stream it as it is generated."""
    parser = submit_parser()
    args = parser.parse_args(argv)
    if args.system is not None and not args.chat:
        parser.error("--system needs --chat")
    messages = None
    if args.chat:
        system = [{"role": "system", "content": args.system}] if args.system is not None else []
        messages = system + [{"role": "user", "content": args.prompt}]
    try:
        constraint = _constraint(args)
        client = Client(args.redis_url, args.namespace)
        request_id = client.submit(
            None if args.chat else args.prompt,
            messages=messages,
            request_id=args.request_id,
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            seed=args.seed,
            constraint=constraint,
            **({"tenant": args.tenant} if args.tenant is not None else {}),
        )
    except ValidationError as exc:
        print(f"npu-pool submit: {invalid_reason(exc, SUBMIT_FLAGS)}", file=sys.stderr)
        return 2
    except (QueueFull, ConnectionError, ValueError) as exc:
        print(f"npu-pool submit: {exc}", file=sys.stderr)
        return 1
    if args.no_wait:
        print(request_id)
        return 0
    print(f"request {request_id}", file=sys.stderr, flush=True)
    if args.stream:
        return _stream(client, request_id, args.timeout)
    completion = client.result(request_id, timeout_s=args.timeout)
    if args.json:
        print(completion.model_dump_json())
    else:
        print(completion.text)
        if completion.error is not None:
            print(f"[{completion.finish_reason}] {completion.error.message}", file=sys.stderr)
    return 0 if completion.error is None else 1


def _stream(client: Client, request_id: str, timeout_s: float) -> int:
    """Print a completion's text as it arrives; non-zero when it ends in error."""
    final = None
    for chunk in client.stream(request_id, timeout_s=timeout_s):
        sys.stdout.write(chunk.text)
        sys.stdout.flush()
        final = chunk
    print()
    if final is not None and final.error is not None:
        print(f"[{final.finish_reason}] {final.error.message}", file=sys.stderr)
    return 0 if final is not None and final.error is None else 1


def cancel_main(argv: list[str]) -> int:
    """Cancel requests: queued ones end at once, running ones by the next step."""
    parser = argparse.ArgumentParser(
        prog="npu-pool cancel",
        description="Cancel requests: queued ones end at once, running ones by the next step. "
        "Exit 1 if an id is not known: neither queued, running, nor finished within its "
        "result_ttl_s.",
    )
    parser.add_argument("request_ids", nargs="+", metavar="ID", help="request ids to cancel")
    add_connection_flags(parser)
    args = parser.parse_args(argv)
    try:
        client = Client(args.redis_url, args.namespace)
    except ConnectionError as exc:
        print(f"npu-pool cancel: {exc}", file=sys.stderr)
        return 1
    code = 0
    for request_id in args.request_ids:
        try:
            found = find_request(client.redis, client.keys, request_id)
        except redis.ConnectionError as exc:
            print(
                f"npu-pool cancel: cannot reach Redis at {redacted_url(client.url)}: {exc}",
                file=sys.stderr,
            )
            return 1
        if found.state == "unknown":
            print(
                f"npu-pool cancel: no request {request_id} is known (not queued, not running, "
                "no result kept)",
                file=sys.stderr,
            )
            code = 1
        elif found.state == "finished":
            print(f"{request_id} already finished ({found.finish_reason}); nothing to cancel")
        else:
            client.cancel(request_id)
            print(f"cancel requested: {request_id} (was {found.state})")
    return code


def status_main(argv: list[str]) -> int:
    """Show pools, ranks (pid, host, device, state) and the queue."""
    parser = argparse.ArgumentParser(prog="npu-pool status", description=status_main.__doc__)
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument(
        "--watch",
        action="store_true",
        help="a live view until Ctrl-C (a snapshot per --interval when not on a terminal)",
    )
    parser.add_argument("--interval", type=float, default=1.0, help="--watch refresh, s")
    parser.add_argument(
        "--url",
        action="store_true",
        help="print the Redis URL only, as in `export REDIS_URL=$(npu-pool status --url)`",
    )
    add_connection_flags(parser)
    args = parser.parse_args(argv)
    try:
        client = Client(args.redis_url, args.namespace)
        if args.url:
            print(client.url)
            return 0
        status = collect_status(client.redis, client.keys)
    except ConnectionError as exc:
        print(f"npu-pool status: {exc}", file=sys.stderr)
        return 1
    except redis.ConnectionError as exc:
        print(
            f"npu-pool status: cannot reach Redis at {redacted_url(client.url)}: {exc}",
            file=sys.stderr,
        )
        return 1
    if args.json:
        print(json.dumps({"redis_url": redacted_url(client.url), **status}, indent=2))
        return 0
    if args.watch:
        watch(client.redis, client.keys, args.interval, client.url)
        return 0
    Console().print(render(status, url=client.url))
    return 0
