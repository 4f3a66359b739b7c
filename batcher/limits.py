"""The namespace's limits, published by its batchers for admission and for clients.

Each pool writes its own values under `pool:{name}` (JSON) in the `{ns}:limits` hash, and
the values that admission reads (`max_queue`, `max_request_bytes`, `max_model_len`) are
the smallest over the pools that hold a live lease: pools that share a namespace share one
bound, and where they disagree the strictest holds. When the last pool stops, its values
stay, so the bound still holds while no pool runs.
"""

from __future__ import annotations

import json
from typing import cast

import redis

from schemas.config import Settings
from schemas.connection import hash_fields
from schemas.keys import Keys
from schemas.tenants import Tenants

LIMITS = ("max_queue", "max_request_bytes", "max_model_len")
POOL_PREFIX = "pool:"


def own_limits(settings: Settings) -> dict[str, int]:
    """This pool's configured limits."""
    return {name: int(getattr(settings, name)) for name in LIMITS}


def publish_limits(
    client: redis.Redis, keys: Keys, pool: str, settings: Settings, live_pools: set[str]
) -> dict[str, int]:
    """Record this pool's limits and set the namespace's to the strictest of the live pools'."""
    mine = own_limits(settings)
    found = read_pool_limits(client, keys)
    found[pool] = mine
    effective = strictest([v for name, v in found.items() if name in live_pools | {pool}])
    mapping: dict[str, str | int] = {POOL_PREFIX + pool: json.dumps(mine), **effective}
    client.hset(keys.limits, mapping=mapping)  # type: ignore[arg-type]
    return effective


def withdraw_limits(client: redis.Redis, keys: Keys, pool: str, live_pools: set[str]) -> None:
    """A stopping pool drops its entry; the others' (if any) set the namespace's limits."""
    found = read_pool_limits(client, keys)
    found.pop(pool, None)
    others = [v for name, v in found.items() if name in live_pools]
    pipe = client.pipeline(transaction=False)
    pipe.hdel(keys.limits, POOL_PREFIX + pool)
    if others:
        pipe.hset(keys.limits, mapping=strictest(others))  # type: ignore[arg-type]
    pipe.execute()


def read_pool_limits(client: redis.Redis, keys: Keys) -> dict[str, dict[str, int]]:
    """Each pool's published limits, by pool name."""
    raw = hash_fields(client.hgetall(keys.limits))
    found: dict[str, dict[str, int]] = {}
    for field, value in raw.items():
        name = field.decode()
        if name.startswith(POOL_PREFIX):
            try:
                found[name[len(POOL_PREFIX) :]] = cast(dict[str, int], json.loads(value))
            except ValueError:
                continue
    return found


def strictest(limits: list[dict[str, int]]) -> dict[str, int]:
    """The smallest value of each limit over several pools'."""
    return {name: min(v[name] for v in limits if name in v) for name in LIMITS}


def publish_tenants(client: redis.Redis, keys: Keys, tenants: Tenants | None) -> None:
    """Tell admission which tenants the namespace allows and their `max_queue`: with a
    tenants file, those it names (and `default`) and nothing else; without one, any name.
    Pools that share a namespace share one tenants file."""
    pipe = client.pipeline(transaction=True)
    pipe.delete(keys.tenants)
    if tenants is None:
        pipe.hdel(keys.limits, "tenants_required")
    else:
        quotas = {name: t.max_queue or "" for name, t in tenants.tenants.items()}
        pipe.hset(keys.tenants, mapping=quotas)  # type: ignore[arg-type]
        pipe.hset(keys.limits, "tenants_required", 1)
    pipe.execute()
