"""Settings: one pydantic-settings model; each field is a flag and an `NPUPOOL_*` variable."""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import platformdirs
from pydantic import AliasChoices, ByteSize, Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from schemas.registry import LaunchShapes
from schemas.tenants import Tenants, load_tenants

# `--model` names that are not paths: models built (tiny, small) or imported (smollm2) into
# the cache on first use (npu_worker/weights/presets.py).
MODEL_PRESETS = ("tiny", "small", "smollm2")
# A service exits with this when a restart cannot help (bad configuration, a model that
# cannot load): supervisors stop instead of restarting it.
EXIT_FAILED = 3


def cache_dir() -> Path:
    """Per-user cache directory (models, embedded Redis data); NPUPOOL_HOME overrides it."""
    override = os.environ.get("NPUPOOL_HOME")
    return Path(override) if override else Path(platformdirs.user_cache_dir("npu-pool"))


class Settings(BaseSettings):
    """Configuration shared by every npu-pool process."""

    model_config = SettingsConfigDict(env_prefix="NPUPOOL_", extra="ignore")

    redis_url: str | None = Field(
        default=None,
        validation_alias=AliasChoices("redis_url", "NPUPOOL_REDIS_URL", "REDIS_URL"),
        description="redis:// or rediss:// URL; default: the local `npu-pool up`",
    )
    namespace: str = Field(default="npupool", description="prefix of every Redis key")
    min_replicas_ack: int | None = Field(
        default=None,
        ge=0,
        le=16,
        description="replicas that must confirm an accepted request and a final "
        "acknowledgement (WAIT); default: 1 with a Sentinel URL, else 0",
    )
    replica_ack_timeout_s: float = Field(
        default=1.0, gt=0.0, description="how long a WAIT for replicas may take"
    )
    pool: str = Field(default="default", description="name of this pool")
    model: str = Field(
        default="tiny",
        description=f"a model directory, a .gguf file, or a preset: {', '.join(MODEL_PRESETS)}",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16", "float64"] = Field(
        default="auto",
        description="weights and KV dtype; auto: the checkpoint's, except bfloat16 for a "
        "float32 checkpoint on a CPU with native bfloat16 (AVX512-BF16 or AMX)",
    )
    device: Literal["auto", "cpu", "cuda", "npu"] = Field(
        default="auto", description="auto picks npu, then cuda, then cpu"
    )
    ranks: int = Field(default=1, ge=1, le=64, description="data-parallel worker ranks")
    max_num_seqs: int = Field(default=64, ge=1, description="admitted requests, whole pool")
    kv_slots_per_rank: int = Field(
        default=16,
        ge=1,
        description="requests a rank runs at once (with --kv-cache-fraction 0, each reserves "
        "max_model_len tokens of cache)",
    )
    kv_cache_memory: ByteSize | None = Field(
        default=None,
        description="cache bytes per rank (e.g. 4GiB), handed out to requests in blocks of "
        "--block-size tokens as they grow; unset: --kv-cache-fraction",
    )
    kv_cache_fraction: float = Field(
        default=0.9,
        ge=0.0,
        le=1.0,
        description="without --kv-cache-memory: the cache of blocks takes this share of the "
        "device's free memory once the weights are loaded (a CPU's available memory split "
        "over the pool's ranks, its pages taken as blocks are first used); 0: no blocks, "
        "each slot reserves max_model_len",
    )
    max_model_len: int = Field(default=1024, ge=2, description="prompt + completion tokens")
    prefill_chunk: int = Field(default=128, ge=1, description="tokens per prefill launch (S)")
    prefill_slots: int = Field(default=4, ge=1, description="prefill launches per rank per step")
    decode_batch: int = Field(default=8, ge=1, description="rows per decode launch (B)")
    pack_prefill: bool = Field(
        default=True,
        description="several prompts per prefill launch (off on ranks whose backend "
        "takes one request per launch)",
    )
    prefill_segments: int = Field(
        default=8, ge=1, le=64, description="prompts in one packed prefill launch, at most"
    )
    mix_decode: bool = Field(
        default=True,
        description="a rank's decode micro-batch rides in the spare room of its packed "
        "prefill launch, a launch fewer (only where its launches give a row the same bits "
        "either way: the CPU kernels' own products, no MTP, no lockstep)",
    )
    prefix_caching: bool = Field(
        default=True,
        description="a prompt that starts with full blocks a slot of its rank holds skips "
        "their prefill (exact: a hit's tokens are a miss's); DeepSeek-V4 only in a cache of "
        "blocks (not with --kv-cache-fraction 0)",
    )
    block_size: int = Field(
        default=128,
        ge=1,
        le=4096,
        description="tokens per cache block: what prefixes share (unset: 128, or what "
        "divides a smaller --prefill-chunk)",
    )
    decode_stall_steps: int = Field(
        default=1,
        ge=0,
        le=64,
        description="steps a rank's decode may wait while more prompts wait than one step "
        "prefills (0: decode every step)",
    )
    decode_kernel: bool = Field(
        default=True,
        description="CPU: attention (decode, verify and prefill), RoPE with the K/V writes "
        "and RMSNorm in a small C library (built with the system's compiler on first use), "
        "each query reading its own keys; off, or no compiler: batched matrix products over "
        "the launch's span and plain torch operations",
    )
    mtp: bool = Field(default=False, description="decode with MTP drafts (K=1)")
    lockstep: bool = Field(default=False, description="every rank runs the same launches")
    expert_parallel: bool = Field(
        default=False,
        description="split a mixture-of-experts model's routed experts over the ranks "
        "(collectives in every launch; implies lockstep)",
    )
    collective_timeout_s: float = Field(
        default=30.0,
        gt=0.0,
        description="expert parallelism: a rendezvous or collective that takes longer fails",
    )
    rendezvous_host: str | None = Field(
        default=None,
        description="expert parallelism: the address other ranks reach rank 0 at; "
        "default: loopback (every rank on one host)",
    )
    max_inflight_steps: int = Field(
        default=4, ge=1, le=8, description="most steps dispatched ahead (two always)"
    )
    max_queue: int = Field(
        default=10000, ge=1, description="outstanding requests accepted in the namespace"
    )
    priority_aging_s: float = Field(
        default=5.0, gt=0.0, description="waiting this long raises effective priority by one"
    )
    preempt_margin: float = Field(
        default=3.0,
        ge=0.0,
        description="preempt a running request for a waiting one this much more urgent",
    )
    preemption: bool = Field(
        default=True,
        description="let urgent requests, and tenants below their share, take busy slots",
    )
    tenants: str | None = Field(
        default=None, description="tenants file (TOML): weights, quotas, API keys"
    )
    max_request_bytes: int = Field(default=1 << 20, ge=256, description="largest entry accepted")
    max_deliveries: int = Field(default=5, ge=1, description="deliveries before an entry is dead")
    result_ttl_s: int = Field(default=3600, ge=1, description="result stream lifetime")
    drain_timeout_s: float = Field(default=30.0, ge=0.0, description="SIGTERM: time to finish")
    heartbeat_s: float = Field(default=1.0, gt=0.0, description="registry heartbeat period")
    rank_timeout_s: float = Field(default=10.0, gt=0.0, description="heartbeat age of a dead rank")
    threads_per_rank: int = Field(default=0, ge=0, description="torch CPU threads, 0: auto")
    metrics_port: int = Field(
        default=0,
        ge=0,
        le=65000,
        description="Prometheus port of the batcher (rank R: +1+R); 0: off",
    )

    @model_validator(mode="after")
    def _consistent(self) -> Settings:
        if self.prefill_chunk > self.max_model_len:
            raise ValueError(
                f"prefill_chunk={self.prefill_chunk} exceeds max_model_len={self.max_model_len}"
            )
        if self.dtype == "float64" and self.device not in ("cpu", "auto"):
            raise ValueError(f"dtype float64 is for the CPU only, not device={self.device}")
        if self.tenants is not None:
            load_tenants(self.tenants)  # a bad file stops the command that reads it, saying why
        if self.blocks and "block_size" not in self.model_fields_set:
            # the default block follows a smaller prefill chunk (a block never straddles two)
            self.block_size = math.gcd(self.block_size, self.prefill_chunk)
        if self.blocks and self.prefill_chunk % self.block_size:
            raise ValueError(
                f"a cache of blocks needs block_size={self.block_size} to divide "
                f"prefill_chunk={self.prefill_chunk}"
            )
        if self.expert_parallel:
            self.lockstep = True  # collectives in every launch: every rank runs them all
        return self

    def tenant_table(self) -> Tenants | None:
        """The tenants file's contents (None: no file, every tenant allowed, weight 1)."""
        return load_tenants(self.tenants) if self.tenants is not None else None

    @property
    def max_kv_len(self) -> int:
        """KV positions per slot: max_model_len rounded up to whole prefill chunks."""
        chunks = -(-self.max_model_len // self.prefill_chunk)
        return chunks * self.prefill_chunk

    def launch_shapes(self) -> LaunchShapes:
        """The shapes every rank of a pool with these settings must run."""
        return LaunchShapes(
            decode_batch=self.decode_batch,
            prefill_chunk=self.prefill_chunk,
            prefill_segments=self.prefill_segments,
            num_slots=self.kv_slots_per_rank,
            max_kv_len=self.max_kv_len,
            mtp=self.mtp,
            expert_parallel=self.expert_parallel,
            model=self.model,
            block_size=self.block_size if self.blocks else 0,
            kv_cache_memory=int(self.kv_cache_memory or 0),
            kv_cache_fraction=0.0 if self.kv_cache_memory else self.kv_cache_fraction,
            ranks_sharing=self.ranks if self.blocks else 0,
        )

    @property
    def blocks(self) -> bool:
        """Whether ranks keep their cache in blocks (a budget in bytes or a share above 0)."""
        return self.kv_cache_memory is not None or self.kv_cache_fraction > 0

    def service_args(self) -> list[str]:
        """This configuration as command-line flags, for child processes."""
        args: list[str] = []
        for name in type(self).model_fields:
            value = getattr(self, name)
            if value is None or name == "redis_url":  # passed by environment, not argv
                continue
            flag = "--" + name.replace("_", "-")
            if isinstance(value, bool):
                args.append(flag if value else "--no-" + name.replace("_", "-"))
            else:
                args += [flag, str(value)]
        return args


def add_settings_flags(parser: argparse.ArgumentParser, only: set[str] | None = None) -> None:
    """Add one `--flag` per Settings field (default None: env and defaults still apply)."""
    for name, field in Settings.model_fields.items():
        if only is not None and name not in only:
            continue
        flag = "--" + name.replace("_", "-")
        annotation = field.annotation
        help_text = field.description or ""
        if annotation is bool:
            parser.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=None, help=help_text
            )
            continue
        kwargs: dict[str, Any] = {"default": None, "help": help_text, "dest": name}
        if get_origin(annotation) is Literal:
            kwargs["choices"] = list(get_args(annotation))
        elif annotation is int:
            kwargs["type"] = int
        elif annotation is float:
            kwargs["type"] = float
        parser.add_argument(flag, **kwargs)


def settings_from_args(args: argparse.Namespace, **overrides: Any) -> Settings:
    """Settings from parsed flags over the environment; raises ValueError on bad values."""
    given = {
        name: getattr(args, name)
        for name in Settings.model_fields
        if getattr(args, name, None) is not None
    }
    given.update(overrides)
    return Settings(**given)
