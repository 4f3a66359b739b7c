"""The gateway's configuration and shared state."""

from __future__ import annotations

from dataclasses import dataclass, field

from producer.client import AsyncClient
from producer.gateway.errors import RETRY_AFTER_S, ApiError
from producer.gateway.pools import PoolWatch


@dataclass
class GatewayConfig:
    """What `npu-pool gateway` is started with."""

    redis_url: str | None = None
    namespace: str | None = None
    api_keys: list[str] = field(default_factory=list)
    # API key -> tenant, from a tenants file; a key of `api_keys` not here is `default`'s
    key_tenants: dict[str, str] = field(default_factory=dict)
    max_body_bytes: int = 1 << 20
    first_chunk_wait_s: float = 10.0
    keepalive_s: float = 15.0
    refresh_s: float = 0.5


class Gateway:
    """The app's state: one client (multiplexed streams), the pools' readiness, the config."""

    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.client = AsyncClient(config.redis_url, config.namespace)
        self.pools = PoolWatch(self.client.url, self.client.keys, config.refresh_s)

    def model_for(self, requested: str) -> tuple[str, int]:
        """(pool name, max_model_len) of a ready pool serving `requested`; else 404 or 503."""
        ready = self.pools.ready()
        if not ready:
            raise ApiError(
                503, "no pool is ready; see `npu-pool status`", code="no_ready_pool",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )  # fmt: skip
        for pool in ready:
            if pool.model == requested:
                return pool.name, pool.max_model_len
        served = ", ".join(sorted({p.model for p in ready}))
        raise ApiError(
            404,
            f"The model `{requested}` does not exist; served: {served}",
            param="model",
            code="model_not_found",
        )
