"""The CPU kernels' library: attention over the cache that reads each query's own live keys
once, RoPE with the K/V writes, RMSNorm, and a bfloat16 linear product, each in one call;
built from C with the system's compiler and called through ctypes.

Batched matrix products over a launch's whole span read every row's keys up to the longest
context in the launch, and at the shapes of a decode launch (a few query heads per KV head)
they run far below the memory's bandwidth. The attention walks each (row, KV head) over
its slot's keys `0..position` in place in the cache, once for all the queries that share
them: a dot product per key, a softmax, a weighted sum of the values, each in one fixed
order that depends only on the row's own context. The dot products are summed 16 keys at
a time through one tree of shuffles (no horizontal sum per key), and bfloat16 keys are
multiplied as bfloat16 pairs accumulated in float32 (AVX512-BF16) where the CPU has it; on
CPUs with AVX2 and no AVX-512 the scores and the values' sums run in registers, 8 lanes at
a time (attention_avx2.c); on CPUs with AMX both are tile products (attention_amx.c), and
so are the bfloat16 products where the probe picks them (matmul_amx.c, products.py).
Prefill chunks pass every token as a row of its own (attention.py), so a prompt token's
attention is computed exactly as its decode would be. So a row's output is bit-identical
whatever else shares its launch and whatever span the launch reads (docs/architecture.md §2).

`rope_store` rotates a launch's queries and keys and writes K/V into the cache (the bits of
`rotate_half` and the indexed writes: no fused multiply-adds, -ffp-contract=off), and
`rms_norm` is Llama's RMSNorm (in bfloat16 the bits of the torch path): each replaces a
dozen small torch operations a layer, whose dispatch cost as much as their arithmetic.

The C (`SOURCE_FILES`, beside this file) is built once per
machine with the system's C compiler into the npu-pool cache (keyed by its source, the
compiler and the CPU) and called through ctypes, which releases the GIL while it runs.
Where there is no compiler or the build fails, `load_cpu_kernels` returns None and the CPU
kit (layers.py) keeps the batched-matrix path and plain torch operations.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import torch

from npu_worker.devices import cpu_flags, cpu_runs_kernel_product, forced_isa
from schemas.config import cache_dir

log = logging.getLogger(__name__)

# shipped as package data, built into one library
SOURCE_FILES = [
    Path(__file__).with_name(name)
    for name in ("kernels.c", "attention_avx2.c", "attention_amx.c", "matmul.c", "matmul_amx.c")
]
HEADER_FILES = [Path(__file__).with_name("vector_math.h")]  # included by them: keys the build

DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC"]
NO_AMX = ["-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8"]  # below AMX: its tiles unused


class CpuKernels:
    """The built library: attention of a launch's queries over the cache (`__call__`),
    RoPE with the K/V writes (`rope_store`) and RMSNorm (`rms_norm`)."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self.path = Path(library._name)
        self.call = library.decode_attention
        tables: list[type[Any]] = [ctypes.c_void_p, ctypes.c_int64] + [ctypes.c_void_p] * 3
        tables += [ctypes.c_int] * 2
        pointers: list[type[Any]] = [ctypes.c_void_p] * 2
        sizes: list[type[Any]] = [ctypes.c_int] * 6 + [ctypes.c_int64] * 6
        tail: list[type[Any]] = [ctypes.c_int, ctypes.c_int, ctypes.c_float, ctypes.c_int]
        self.call.argtypes = tables + pointers + sizes + tail
        self.call.restype = ctypes.c_int

        self.store = library.rope_store
        self.store.argtypes = [ctypes.c_void_p] * 9 + [ctypes.c_int] * 4 + [ctypes.c_int64] * 9
        self.store.argtypes += [ctypes.c_int]
        self.store.restype = ctypes.c_int
        self.norm = library.rms_norm
        self.norm.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int] * 2
        self.norm.argtypes += [ctypes.c_float, ctypes.c_int]
        self.norm.restype = ctypes.c_int
        self.packed_size = library.packed_linear_size
        self.packed_size.argtypes = [ctypes.c_int, ctypes.c_int]
        self.packed_size.restype = ctypes.c_int64
        self.pack = library.pack_linear
        self.pack.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int64]
        self.pack.argtypes += [ctypes.c_void_p]
        self.pack.restype = None
        self.product = library.linear_bf16
        self.product.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int64]
        self.product.argtypes += [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
        self.product.argtypes += [ctypes.c_int64, ctypes.c_int]
        self.product.restype = ctypes.c_int
        self.tile_product = library.linear_bf16_tiles
        self.tile_product.argtypes = self.product.argtypes
        self.tile_product.restype = ctypes.c_int
        self.has_tiles = bool(library.tiles_available())
        self.gated_product = library.gated_bf16_tiles
        self.gated_product.argtypes = self.product.argtypes
        self.gated_product.restype = ctypes.c_int
        self.fp4_product = library.linear_mxfp4
        self.fp4_product.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int64]
        self.fp4_product.argtypes += [ctypes.c_void_p] * 2 + [ctypes.c_int] + [ctypes.c_void_p] * 2
        self.fp4_product.argtypes += [ctypes.c_int64, ctypes.c_int]
        self.fp4_product.restype = ctypes.c_int
        self.has_mxfp4 = bool(library.mxfp4_available())
        self.fp8_product = library.linear_fp8
        self.fp8_product.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int64]
        self.fp8_product.argtypes += [ctypes.c_void_p] * 2 + [ctypes.c_int] * 2
        self.fp8_product.argtypes += [ctypes.c_void_p] * 2 + [ctypes.c_int64, ctypes.c_int]
        self.fp8_product.restype = ctypes.c_int
        self.has_fp8 = bool(library.fp8_available())

    def pack_linear(self, weight: torch.Tensor) -> torch.Tensor:
        """A bfloat16 weight [outputs, inputs] laid out for `linear` (blocks of 16 outputs
        by pairs of inputs, zeros past the edges)."""
        outputs, inputs = weight.shape
        weight = weight.detach().contiguous()
        packed = torch.empty(self.packed_size(outputs, inputs), dtype=torch.bfloat16)
        self.pack(weight.data_ptr(), outputs, inputs, weight.stride(0), packed.data_ptr())
        return packed

    def linear(
        self, x: torch.Tensor, packed: torch.Tensor, outputs: int, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """x [..., inputs] bfloat16 times a weight packed by `pack_linear`, plus the bias
        (summed in float32, rounded to bfloat16 once): [..., outputs] bfloat16. A row's
        bits depend only on that row (matmul.c)."""
        return self._rows_times(self.product, "linear_bf16", x, outputs, bias, packed.data_ptr())

    def linear_tiles(
        self, x: torch.Tensor, packed: torch.Tensor, outputs: int, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """`linear` on AMX tiles (matmul_amx.c), inputs a multiple of 32: other bits than
        `linear`'s, and again a row's depend only on that row."""
        return self._rows_times(
            self.tile_product, "linear_bf16_tiles", x, outputs, bias, packed.data_ptr()
        )

    def gated_tiles(self, x: torch.Tensor, packed: torch.Tensor, outputs: int) -> torch.Tensor:
        """silu(x gate) * (x up) on AMX tiles (matmul_amx.c), `packed` gate's and then up's
        weights laid out as one by `pack_linear` (`outputs` in all, a multiple of 32),
        inputs a multiple of 32: [..., outputs / 2] bfloat16, each step rounded to bfloat16
        as the unfused form rounds it. A row's bits depend only on that row."""
        return self._rows_times(
            self.gated_product,
            "gated_bf16_tiles",
            x,
            outputs,
            None,
            packed.data_ptr(),
            width=outputs // 2,
        )

    def linear_mxfp4(
        self,
        x: torch.Tensor,
        packed: torch.Tensor,
        scales: torch.Tensor,
        outputs: int,
        bias: torch.Tensor | None,
    ) -> torch.Tensor:
        """x [..., inputs] bfloat16 times an MXFP4 weight in the kernels' layout (`packed`
        [blocks, inputs / 2, 16] and `scales` [blocks, inputs / 32, 16] bytes), plus the bias
        (float32 sums, rounded to bfloat16 once): the bits of `linear` over the dequantized
        weight (matmul.c)."""
        weight = (packed.data_ptr(), scales.data_ptr())
        return self._rows_times(self.fp4_product, "linear_mxfp4", x, outputs, bias, *weight)

    def linear_fp8(
        self,
        x: torch.Tensor,
        packed: torch.Tensor,
        scales: torch.Tensor,
        group: int,
        outputs: int,
        bias: torch.Tensor | None,
    ) -> torch.Tensor:
        """x [..., inputs] bfloat16 times an FP8 weight in the kernels' layout (`packed`
        [blocks, inputs / 2, 16, 2] e4m3 bytes, `scales` [blocks, ceil(inputs / group)]
        float32), plus the bias (float32 sums, rounded to bfloat16 once): the bits of
        `linear` over the dequantized weight rounded to bfloat16 (matmul.c)."""
        weight = (packed.data_ptr(), scales.contiguous().data_ptr(), group)
        return self._rows_times(self.fp8_product, "linear_fp8", x, outputs, bias, *weight)

    @staticmethod
    def _rows_times(
        product: Any,
        name: str,
        x: torch.Tensor,
        outputs: int,
        bias: torch.Tensor | None,
        *weight: int,
        width: int | None = None,
    ) -> torch.Tensor:
        """One of matmul.c's (or matmul_amx.c's) products, `product(x, rows, inputs,
        x_stride, *weight, outputs, bias, out, out_stride, threads)`, over x's rows:
        [..., width] bfloat16 (`width` the outputs unless the product gives fewer)."""
        inputs = x.shape[-1]
        rows = x.reshape(-1, inputs)
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        width = outputs if width is None else width
        out = torch.empty(rows.shape[0], width, dtype=torch.bfloat16)
        added = None if bias is None else bias.detach().float().contiguous()
        failed = product(
            rows.data_ptr(),
            rows.shape[0],
            inputs,
            rows.stride(0),
            *weight,
            outputs,
            None if added is None else added.data_ptr(),
            out.data_ptr(),
            width,
            torch.get_num_threads(),
        )
        if failed:
            raise RuntimeError(f"{name} failed ({failed}): not in this build, or out of memory")
        return out.view(*x.shape[:-1], width)

    def rope_store(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slots: torch.Tensor,
        positions: torch.Tensor,
    ) -> None:
        """Rotate q [T, H, D] in place (rotate-half RoPE, cos and sin [T, D] float32), and
        write token t's rotated keys and its values k, v [T, Hkv, D] into the cache at
        slot `slots[t]`, position `positions[t]`: what `rotate_half` and `write_cache` do,
        bit for bit, in one call. q, k and v are in the cache's dtype with heads and channels
        contiguous; their tokens may be further apart (slices of one fused projection)."""
        tokens, heads, dim = q.shape
        cos, sin = cos.contiguous(), sin.contiguous()
        slots, positions = slots.contiguous(), positions.contiguous()
        failed = self.store(
            q.data_ptr(),
            k.data_ptr(),
            v.data_ptr(),
            cos.data_ptr(),
            sin.data_ptr(),
            slots.data_ptr(),
            positions.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            tokens,
            heads,
            k.shape[1],
            dim,
            q.stride(0),
            k.stride(0),
            v.stride(0),
            *k_cache.stride()[:3],
            *v_cache.stride()[:3],
            DTYPE_CODES[k_cache.dtype],
        )
        if failed:
            raise MemoryError("rope_store could not allocate its work buffer")

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm of x's last dimension, as `models.layers.RMSNorm` computes it (float32
        statistics, the normalised row rounded to x's dtype before the weight), in one
        call; x contiguous, weight of x's dtype."""
        out = torch.empty_like(x)
        size = x.shape[-1]
        failed = self.norm(
            x.data_ptr(),
            weight.data_ptr(),
            out.data_ptr(),
            x.numel() // size,
            size,
            eps,
            DTYPE_CODES[x.dtype],
        )
        if failed:
            raise MemoryError("rms_norm could not allocate its work buffer")
        return out

    def supports(self, cache: torch.Tensor) -> bool:
        """True for a cache this kernel reads: CPU, float32 or bfloat16, channels contiguous."""
        return cache.device.type == "cpu" and cache.dtype in DTYPE_CODES and cache.stride(-1) == 1

    def __call__(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_ids: torch.Tensor,
        positions: torch.Tensor,
        span: int,
        scale: float,
        tables: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q [B, S, H, D] over cache [slots, Hkv, positions, D]: query (b, s) sees its slot's
        keys up to `positions[b, s]`; a query at or past `span` (padding) sees none and
        gets zeros. Returns [B, S, H, Dv] in q's dtype.

        With `tables` [B, width] the cache is [blocks, Hkv, block_size, D] and row b's
        position p lies in block `tables[b, p // block_size]` (`slot_ids` unused)."""
        batch, seq, heads, dim = q.shape
        kv_heads, value_dim = k_cache.shape[1], v_cache.shape[-1]
        query = q.to(k_cache.dtype)
        q_row = token_stride(query)
        if q_row is None:
            query = query.contiguous()
            q_row = heads * dim
        if tables is None:  # one block a slot: its whole run of positions
            tables = slot_ids[:, None]
        tables, row_positions = tables.contiguous(), positions.contiguous()  # held over the call
        out = torch.empty(batch, seq, heads, value_dim, dtype=k_cache.dtype)
        failed = self.call(
            query.data_ptr(),
            q_row,
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            tables.data_ptr(),
            tables.shape[1],
            k_cache.shape[2],
            row_positions.data_ptr(),
            out.data_ptr(),
            batch,
            seq,
            heads,
            kv_heads,
            dim,
            value_dim,
            *k_cache.stride()[:3],
            *v_cache.stride()[:3],
            span,
            DTYPE_CODES[k_cache.dtype],
            scale,
            torch.get_num_threads(),
        )
        if failed == 2:
            raise ValueError(f"span {span} reads past the {tables.shape[1]} blocks a row holds")
        if failed:
            raise MemoryError("CPU attention could not allocate its work buffers")
        return out.to(q.dtype)


def token_stride(x: torch.Tensor) -> int | None:
    """The elements between consecutive tokens of x [B, S, H, D] where each token's heads
    and channels are one contiguous run, tokens a fixed stride apart (contiguous, or a
    slice of one fused projection's output); None where they are not."""
    batch, seq, heads, dim = x.shape
    if x.stride(3) != 1 or x.stride(2) != dim:
        return None
    if batch * seq == 1:
        return heads * dim
    if batch == 1 or seq == 1:  # a dimension of one may have any stride
        step = x.stride(1) if batch == 1 else x.stride(0)
        return step if step >= heads * dim else None
    if x.stride(1) >= heads * dim and x.stride(0) == seq * x.stride(1):
        return x.stride(1)
    return None


def load_cpu_kernels() -> CpuKernels | None:
    """The kernel, built on first use into the cache; None (with the reason logged once)
    where this machine cannot build or load it."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.info("CPU kernels: no C compiler found; using batched matrix products")
        return None
    try:
        return CpuKernels(ctypes.CDLL(str(_built(compiler))))
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning(
            "CPU kernels: building them failed (%s); using batched matrix products",
            exc,
        )
        return None


def _built(compiler: str) -> Path:
    """The shared library for this source, compiler and CPU, compiled once (atomically, so
    ranks starting together never load a half-written file)."""
    sources = [path.read_text() for path in (*SOURCE_FILES, *HEADER_FILES)]
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, check=True, timeout=30
    ).stdout
    key = hashlib.sha256(
        "\0".join(
            [*sources, compiler, version, *compile_flags(), platform.machine(), _cpu_flags()]
        ).encode()
    ).hexdigest()[:16]
    target = cache_dir() / "kernels" / f"cpu_kernels-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        built = Path(scratch) / target.name
        result = subprocess.run(
            [compiler, *compile_flags(), *map(str, SOURCE_FILES), "-o", str(built), "-lm"],
            capture_output=True,
            text=True,
            timeout=300,
        )
        if result.returncode != 0:
            raise OSError(f"{compiler} exited {result.returncode}: {result.stderr.strip()[-400:]}")
        os.replace(built, target)
    return target


def has_kernel_linear() -> bool:
    """Whether the kernels' `linear` runs here (as `NPUPOOL_CPU_ISA` leaves the CPU)."""
    return cpu_runs_kernel_product()


def compile_flags() -> list[str]:
    """The compiler's flags for the instruction set the kernels are built for."""
    isa = forced_isa()
    no_amx = NO_AMX if _native_amx() else []  # (older compilers know no AMX flags)
    if isa == "avx2":
        return [*FLAGS, "-mno-avx512f", *no_amx]
    if isa == "avx512":
        return [*FLAGS, *no_amx]
    if isa == "portable" and platform.machine() in ("x86_64", "AMD64"):
        return [f if f != "-march=native" else "-march=x86-64" for f in FLAGS]
    return FLAGS


def _native_amx() -> bool:
    """Whether the CPU itself has AMX tiles (which `-march=native` would build for)."""
    try:
        return " amx_tile" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def _cpu_flags() -> str:
    """The CPU's feature flags as the build sees them (a key of the built library)."""
    return " ".join(sorted(cpu_flags())) or platform.processor()
