"""`npu-pool gateway`: serve the OpenAI-compatible HTTP front with uvicorn."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from producer.gateway.state import GatewayConfig
from schemas.tenants import load_tenants

API_KEYS_ENV = "NPUPOOL_API_KEYS"


def build_parser() -> argparse.ArgumentParser:
    """The command's flags."""
    parser = argparse.ArgumentParser(
        prog="npu-pool gateway",
        description="OpenAI-compatible HTTP front of the pool (/v1/completions, "
        "/v1/chat/completions, /v1/models) with resumable SSE result streams "
        "(/v1/requests/ID/events) and /health.",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (default: 8000)")
    parser.add_argument(
        "--redis-url",
        default=None,
        help="default: REDIS_URL, else the running `npu-pool up` (`npu-pool status --url`)",
    )
    parser.add_argument(
        "--namespace", default=None, help="prefix of the pools' Redis keys (default: npupool)"
    )
    parser.add_argument(
        "--api-key",
        action="append",
        default=[],
        help=f"accept this Bearer key (repeatable; also {API_KEYS_ENV}, comma-separated); "
        "none: no key needed",
    )
    parser.add_argument(
        "--tenants",
        default=None,
        help="tenants file (TOML; also NPUPOOL_TENANTS): each tenant's `api_keys` are keys "
        "this gateway takes, and its requests are queued for that tenant; a key it does not "
        "name gets 401 (keys of --api-key queue for `default`)",
    )
    parser.add_argument(
        "--max-body-bytes", type=int, default=1 << 20, help="largest request body accepted"
    )
    parser.add_argument(
        "--first-chunk-wait-s",
        type=float,
        default=10.0,
        help="a stream waits this long for its first chunk before answering 200, so an "
        "early rejection can still be an HTTP error",
    )
    parser.add_argument("--access-log", action="store_true", help="one log line per request")
    parser.add_argument(
        "--log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug"],
        help="least severe log lines shown (default: info)",
    )
    return parser


def config_from_args(args: argparse.Namespace) -> GatewayConfig:
    """The gateway's configuration from its flags and NPUPOOL_API_KEYS."""
    keys = list(args.api_key)
    keys += [k.strip() for k in os.environ.get(API_KEYS_ENV, "").split(",") if k.strip()]
    if args.max_body_bytes < 1024:
        raise ValueError(f"--max-body-bytes={args.max_body_bytes} is below 1024")
    path = args.tenants or os.environ.get("NPUPOOL_TENANTS") or None
    key_tenants = load_tenants(path).by_api_key() if path else {}
    keys += [k for k in key_tenants if k not in keys]
    return GatewayConfig(
        redis_url=args.redis_url,
        namespace=args.namespace,
        api_keys=keys,
        key_tenants=key_tenants,
        max_body_bytes=args.max_body_bytes,
        first_chunk_wait_s=args.first_chunk_wait_s,
    )


def main(argv: list[str]) -> int:
    """Run the gateway until Ctrl-C or SIGTERM."""
    import uvicorn

    from producer.gateway.app import create_app

    args = build_parser().parse_args(argv)
    try:
        config = config_from_args(args)
        app = create_app(config)
    except (ValueError, ConnectionError) as exc:
        print(f"npu-pool gateway: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s gateway %(message)s")
    if args.host not in ("127.0.0.1", "localhost", "::1") and not config.api_keys:
        logging.warning(
            "listening on %s with no API key: anyone who reaches it may use it", args.host
        )
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        access_log=args.access_log,
        timeout_graceful_shutdown=5,
    )
    return 0
