"""PagedAttention on the host, compiled: the kernel the ONNX Runtime runner executes.

The NumPy implementation (:mod:`kvflow.plugins.paged_attention_host`) gathers every K/V block of
every sequence into a new array each layer and then multiplies. This kernel reads the blocks in
place, through the block table, one key at a time with an online softmax in fp32 (FlashAttention's
running max and sum), so that each byte of the cache is read once per step. Work items are
(sequence, KV head) pairs spread over the cores with ``numba.prange``; the query heads of a KV
head's group share each key as it is loaded. A prefill chunk is the same loop with more than one
query per sequence, causal within the chunk. It runs without the GIL.

An fp16 pool (``kv_cache_dtype=fp16``) is read through a uint16 view (numba has no float16 on
the CPU): each (block, KV head) is converted to fp32 once, exactly, into a scratch block
that the group's query heads then share; the arithmetic is the fp32 kernel's. New K/V are
written by NumPy, rounding to nearest even.

With a sliding window each query starts at its window's first block (earlier blocks of the
table are never looked up: the KV manager may have released them) and skips the keys of that
block before its window; soft-capping applies ``cap * tanh(s / cap)`` to each score.

It is compiled by numba (LLVM, bundled with the ``llvmlite`` wheel: no system compiler at run
time) at first use and cached on disk beside this file, so a later process loads it in well
under a second. ``docs/benchmarks.md`` compares it with the NumPy implementation.
"""

from __future__ import annotations

import math

import numba
import numpy as np
from llvmlite import ir
from numba.core import types
from numba.extending import intrinsic, overload

from kvflow.plugins import kv_registry
from kvflow.plugins.attention_options import check_attention_options
from kvflow.plugins.paged_attention_host import write_kv


def _host_converts_halves() -> bool:
    """Whether LLVM widens a half with one instruction here (x86 with F16C, or not x86);
    without one it would call a compiler-rt routine that numba's JIT does not link."""
    import llvmlite.binding as llvm

    if not llvm.get_process_triple().startswith(("x86_64", "i386", "i686")):
        return True
    return bool(llvm.get_host_cpu_features().get("f16c", False))


def _widen_in_software(builder, h):
    """IEEE half bits ``h`` (i16) as float, exactly, in integer ops and one multiply: the
    exponent and mantissa bits shifted into a float's read as the value times 2^-112 (a float
    subnormal for a half subnormal), which one exact multiply rescales; an all-ones half
    exponent (inf, NaN) then gets the float's; the sign goes on last."""
    i32, f32 = ir.IntType(32), ir.FloatType()

    def c(value: int) -> ir.Constant:
        return ir.Constant(i32, value)

    u = builder.zext(h, i32)
    magnitude = builder.shl(builder.and_(u, c(0x7FFF)), c(13))
    scaled = builder.fmul(builder.bitcast(magnitude, f32), ir.Constant(f32, 2.0 ** 112))
    all_ones = builder.lshr(builder.add(builder.and_(u, c(0x7C00)), c(0x0400)), c(15))
    sign = builder.shl(builder.and_(u, c(0x8000)), c(16))
    bits = builder.or_(builder.or_(builder.bitcast(scaled, i32),
                                   builder.mul(all_ones, c(0x7F800000))), sign)
    return builder.bitcast(bits, f32)


def _make_half_to_float(hardware: bool):
    @intrinsic
    def convert(typingctx, h):
        if h != types.uint16:
            return None

        def codegen(context, builder, signature, args):
            if hardware:  # IEEE widening: exact (a signalling NaN comes back quiet)
                return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())
            return _widen_in_software(builder, args[0])

        return types.float32(types.uint16), codegen

    return convert


# IEEE half bits (uint16) -> float32, exactly: F16C's vcvtph2ps where there is one (about ten
# times faster: it vectorises), else integer ops. Both are checked on all 65,536 halves.
half_to_float_software = _make_half_to_float(hardware=False)
half_to_float = _make_half_to_float(hardware=_host_converts_halves())


# What the kernel does per pool type, chosen when numba compiles it for the pool's arrays:
# an fp32 pool is read in place; an fp16 pool (a uint16 view) through an fp32 scratch block.
def _scratch(cache, rows, cols):  # pragma: no cover
    """A per-work-item fp32 block buffer ``[rows, cols]`` (empty for an fp32 pool)."""


def _stage(cache, buf, blk, h, keys):  # pragma: no cover
    """Convert ``cache[blk, :keys, h]`` into ``buf`` (nothing for an fp32 pool)."""


def _row(cache, buf, blk, o, h):  # pragma: no cover
    """Key/value ``o`` of head ``h`` in block ``blk``, as fp32 ``[head_dim]``."""


def _is_half(cache) -> bool:
    return cache.dtype == types.uint16


@overload(_scratch)
def _scratch_impl(cache, rows, cols):
    if _is_half(cache):
        return lambda cache, rows, cols: np.empty((rows, cols), dtype=np.float32)
    return lambda cache, rows, cols: np.empty((0, cols), dtype=np.float32)


@overload(_stage)
def _stage_impl(cache, buf, blk, h, keys):
    if _is_half(cache):
        def stage(cache, buf, blk, h, keys):
            for o in range(keys):
                src = cache[blk, o, h]
                dst = buf[o]
                for x in range(dst.shape[0]):
                    dst[x] = half_to_float(src[x])
        return stage
    return lambda cache, buf, blk, h, keys: None


@overload(_row)
def _row_impl(cache, buf, blk, o, h):
    if _is_half(cache):
        return lambda cache, buf, blk, o, h: buf[o]
    return lambda cache, buf, blk, o, h: cache[blk, o, h]


@numba.njit(nogil=True, cache=True)
def _write_kv(k, v, slot_mapping, k_cache, v_cache):  # pragma: no cover  (compiled)
    block_size = k_cache.shape[1]
    kvh, d = k_cache.shape[2], k_cache.shape[3]
    for t in range(slot_mapping.shape[0]):
        slot = slot_mapping[t]
        if slot < 0:
            continue
        blk, off = slot // block_size, slot % block_size
        for h in range(kvh):
            for x in range(d):
                k_cache[blk, off, h, x] = k[t, h * d + x]
                v_cache[blk, off, h, x] = v[t, h * d + x]


def _attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out,
               num_heads, scale, window, softcap):  # pragma: no cover  (compiled)
    num_seqs = seq_lens.shape[0]
    block_size, kvh, d = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    group = num_heads // kvh
    for item in numba.prange(num_seqs * kvh):
        s, h = item // kvh, item % kvh
        start = query_start_loc[s]
        n = query_start_loc[s + 1] - start
        length = seq_lens[s]
        qg = np.empty((group, d), dtype=np.float32)
        acc = np.empty((group, d), dtype=np.float32)
        m = np.empty(group, dtype=np.float32)
        denom = np.empty(group, dtype=np.float32)
        p = np.empty((group, block_size), dtype=np.float32)
        kbuf = _scratch(k_cache, block_size, d)
        vbuf = _scratch(v_cache, block_size, d)
        for i in range(n):
            visible = length - n + i + 1  # causal: keys up to this token's own position
            # Its window's first key; the blocks before it are never looked up (the KV
            # manager may have released them).
            lo = max(0, visible - window) if window > 0 else 0
            for g in range(group):
                base = (h * group + g) * d
                for x in range(d):
                    qg[g, x] = q[start + i, base + x] * scale
                    acc[g, x] = np.float32(0.0)
                m[g] = np.float32(-np.inf)
                denom[g] = np.float32(0.0)
            for b in range(lo // block_size, (visible + block_size - 1) // block_size):
                blk = block_tables[s, b]
                keys = min(block_size, visible - b * block_size)
                o0 = max(0, lo - b * block_size)
                _stage(k_cache, kbuf, blk, h, keys)
                _stage(v_cache, vbuf, blk, h, keys)
                for g in range(group):
                    qv, av, pv = qg[g], acc[g], p[g]
                    block_max = np.float32(-np.inf)
                    for o in range(o0, keys):
                        kv = _row(k_cache, kbuf, blk, o, h)
                        dot = np.float32(0.0)
                        for x in range(d):
                            dot += qv[x] * kv[x]
                        if softcap > 0:
                            dot = softcap * np.float32(math.tanh(dot / softcap))
                        pv[o] = dot
                        block_max = max(block_max, dot)
                    # online softmax: rescale what was accumulated to the new running max
                    new_max = max(m[g], block_max)
                    correction = np.float32(math.exp(m[g] - new_max))
                    m[g] = new_max
                    total = denom[g] * correction
                    for x in range(d):
                        av[x] *= correction
                    for o in range(o0, keys):
                        w = np.float32(math.exp(pv[o] - new_max))
                        total += w
                        vv = _row(v_cache, vbuf, blk, o, h)
                        for x in range(d):
                            av[x] += w * vv[x]
                    denom[g] = total
            for g in range(group):
                base = (h * group + g) * d
                inv = np.float32(1.0) / denom[g]
                for x in range(d):
                    out[start + i, base + x] = acc[g, x] * inv


# One kernel, compiled twice: spread over the cores, and on the calling thread for small steps,
# where waking the worker threads costs more than the work (a single-stream decode).
_attention_parallel = numba.njit(parallel=True, nogil=True, cache=True, fastmath=True)(
    _attention)
_attention_serial = numba.njit(nogil=True, cache=True, fastmath=True)(_attention)
# Keys read by the step (summed over sequences, KV heads and query tokens) from which the
# parallel kernel wins.
PARALLEL_MIN_KEY_READS = 16384


def paged_attention_native(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    kv_cache_ptrs: np.ndarray,
    slot_mapping: np.ndarray,
    block_tables: np.ndarray,
    seq_lens: np.ndarray,
    query_start_loc: np.ndarray,
    *,
    layer_idx: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    scale: float,
    sliding_window: int = 0,
    logit_softcap: float = 0.0,
) -> np.ndarray:
    """One layer: ``q`` ``[T, H*D]``, ``k``/``v`` ``[T, KVH*D]`` -> ``[T, H*D]`` (fp32).

    The arguments are those of the ONNX node ``kvflow::PagedAttention``; the pool (float32 or
    float16) is reached through ``kv_cache_ptrs`` and :mod:`kvflow.plugins.kv_registry`.
    ``sliding_window`` and ``logit_softcap``: the node's optional attributes (0 = off).
    """
    check_attention_options(sliding_window, logit_softcap)
    k_cache = kv_registry.lookup(int(kv_cache_ptrs[layer_idx, 0]))
    v_cache = kv_registry.lookup(int(kv_cache_ptrs[layer_idx, 1]))
    if k_cache.shape[2:] != (num_kv_heads, head_dim):
        raise ValueError(f"KV pool of layer {layer_idx} has heads x dim {k_cache.shape[2:]}, "
                         f"the node says {(num_kv_heads, head_dim)}")
    q = np.ascontiguousarray(q, dtype=np.float32)
    if k_cache.dtype == np.float32:
        _write_kv(np.ascontiguousarray(k, dtype=np.float32), np.ascontiguousarray(v, np.float32),
                  slot_mapping.astype(np.int64, copy=False), k_cache, v_cache)
    elif k_cache.dtype == np.float16:
        write_kv(k, v, k_cache, v_cache, slot_mapping)
        k_cache, v_cache = k_cache.view(np.uint16), v_cache.view(np.uint16)
    else:
        raise ValueError(f"KV pool of layer {layer_idx} is {k_cache.dtype}; this kernel reads "
                         "float32 and float16 pools")
    out = np.empty_like(q)
    lens = seq_lens.astype(np.int32, copy=False)
    qsl = query_start_loc.astype(np.int32, copy=False)
    new = np.diff(qsl).astype(np.int64)
    keys_seen = lens.astype(np.int64)
    if sliding_window:
        keys_seen = np.minimum(keys_seen, sliding_window + new)
    key_reads = int(np.dot(keys_seen, new)) * num_kv_heads
    kernel = _attention_parallel if key_reads >= PARALLEL_MIN_KEY_READS else _attention_serial
    kernel(q, k_cache, v_cache, block_tables.astype(np.int32, copy=False),
           lens, qsl, out, num_heads, np.float32(scale), np.int64(sliding_window),
           np.float32(logit_softcap))
    return out
