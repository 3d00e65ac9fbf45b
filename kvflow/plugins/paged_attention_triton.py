"""PagedAttention as OpenAI Triton kernels: the GPU implementation of the PagedAttention node.

Same semantics as :mod:`kvflow.plugins.paged_attention_ref` (docs/design.md, "Engine I/O
contract"), in two launches per layer:

1. ``_write_kv_kernel``: one program per (token, KV head) copies the new K/V row into the
   pool at ``slot_mapping[t]`` (negative: skip).
2. ``_paged_attention_kernel``: one program per (sequence, KV head, tile of ``BLOCK_M`` query
   tokens). Prefill chunks and decodes go in the same launch; a decode is a sequence whose
   single tile holds one token, and programs past a sequence's last token return at once.
   The rows of a program are its tokens times the query heads of its KV head (GQA), so each
   key and value is read once per group. Keys are visited ``BLOCK_N`` positions at a time,
   each position's block found through the block table, with an online softmax in fp32
   (flash attention). Inputs may be fp32, fp16 or bf16; accumulation is fp32.
   With a sliding window the keys start at the window of the tile's first token, so that no
   block-table entry before it is read (the KV manager may have released those blocks), and a
   decode reads only its window's blocks; each row masks the keys before its own window.
   Soft-capping (``SOFTCAP``, a constexpr: one compile per value) caps the scores before the
   mask.
3. Split KV (flash decoding), for decode steps with too few (sequence, KV head) programs to
   fill the GPU, such as one long sequence: each program's keys are cut into ``NUM_SPLITS``
   ranges, one program each, which write partial results (output, running max, sum) to a
   scratch buffer; ``_combine_splits_kernel`` merges them per (token, head). The number of
   splits depends on the batch size and the GPU only (the ranges are cut in the kernel from
   each sequence's length), so a decode step captured in a CUDA graph keeps it.

On a machine without CUDA the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, set
before triton is imported), which is how CI checks them against the reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvflow.plugins.attention_options import check_attention_options

# The window of full attention: past any position (an int32 in the kernel).
NO_WINDOW = 1 << 30


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                     stride_kt, stride_kh, stride_vt, stride_vh, stride_cache_slot,
                     stride_cache_h, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        d = tl.arange(0, BLOCK_D)
        dm = d < HEAD_DIM
        k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=dm)
        v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=dm)
        dst = slot * stride_cache_slot + h * stride_cache_h + d
        tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=dm)
        tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=dm)


@triton.jit
def _paged_attention_kernel(
    q_ptr, out_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, qsl_ptr, scale,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_cache_slot, stride_cache_h,
    stride_bt, block_size, part_o_ptr, part_ml_ptr, num_tokens, num_heads, window,
    GROUP: tl.constexpr, GROUP_P: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_FP32: tl.constexpr, NUM_SPLITS: tl.constexpr, SOFTCAP: tl.constexpr,
):
    s = tl.program_id(0)
    kvh = tl.program_id(1)
    tile = tl.program_id(2) // NUM_SPLITS
    split = tl.program_id(2) % NUM_SPLITS
    q_start = tl.load(qsl_ptr + s)
    q_len = tl.load(qsl_ptr + s + 1) - q_start
    if tile * BLOCK_M >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + s)
    context = seq_len - q_len  # positions already cached before this step's tokens

    # Rows: BLOCK_M tokens x GROUP_P query heads (heads past GROUP are padding).
    rows = tl.arange(0, BLOCK_M * GROUP_P)
    tok = tile * BLOCK_M + rows // GROUP_P
    head = kvh * GROUP + rows % GROUP_P
    row_ok = (tok < q_len) & (rows % GROUP_P < GROUP)
    q_pos = context + tok
    d = tl.arange(0, BLOCK_D)
    dm = d < HEAD_DIM
    q_off = (q_start + tok).to(tl.int64) * stride_qt + head * stride_qh
    q = tl.load(q_ptr + q_off[:, None] + d[None, :], mask=row_ok[:, None] & dm[None, :],
                other=0.0).to(k_cache_ptr.dtype.element_ty)

    m_i = tl.full([BLOCK_M * GROUP_P], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M * GROUP_P], tl.float32)
    acc = tl.zeros([BLOCK_M * GROUP_P, BLOCK_D], tl.float32)
    # The last key any row of this tile sees is the position of its last token.
    last_tok = tl.minimum(tile * BLOCK_M + BLOCK_M, q_len) - 1
    kv_end = context + last_tok + 1
    # The first key any row sees: the window's start for the tile's first token (``window``
    # is huge without one). Earlier block-table entries are never read.
    kv_start = tl.maximum(context + tile * BLOCK_M - window + 1, 0)
    # This program's keys: all of them, or its split's range (whole BLOCK_N tiles).
    per_split = tl.cdiv(tl.cdiv(kv_end - kv_start, NUM_SPLITS), BLOCK_N) * BLOCK_N
    n_start = kv_start + split * per_split
    n_stop = tl.minimum(n_start + per_split, kv_end)
    table = block_tables_ptr + s.to(tl.int64) * stride_bt
    for n0 in range(n_start, n_stop, BLOCK_N):
        kpos = n0 + tl.arange(0, BLOCK_N)
        k_ok = kpos < n_stop
        block = tl.load(table + kpos // block_size, mask=k_ok, other=0).to(tl.int64)
        slot = block * block_size + kpos % block_size
        kv_off = slot[:, None] * stride_cache_slot + kvh * stride_cache_h + d[None, :]
        kv_mask = k_ok[:, None] & dm[None, :]
        keys = tl.load(k_cache_ptr + kv_off, mask=kv_mask, other=0.0)
        # Both loads are issued before any math, so that a decode (all memory traffic) has
        # the values in flight while the scores are computed.
        values = tl.load(v_cache_ptr + kv_off, mask=kv_mask, other=0.0)
        # Products in the cache dtype, sums in fp32 (fp32 caches: exact, not TF32).
        if IS_FP32:
            scores = tl.dot(q, tl.trans(keys), input_precision="ieee") * scale
        else:
            scores = tl.dot(q, tl.trans(keys)) * scale
        if SOFTCAP != 0.0:  # cap * tanh(s / cap), tanh from exp (the interpreter has no tanh)
            e = tl.exp(-2.0 * tl.abs(scores / SOFTCAP))
            t = (1.0 - e) / (1.0 + e)
            scores = SOFTCAP * tl.where(scores < 0.0, -t, t)
        visible = ((kpos[None, :] <= q_pos[:, None]) & (kpos[None, :] > q_pos[:, None] - window)
                   & k_ok[None, :] & row_ok[:, None])
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        # NOTE: padded rows see no key, nor do rows whose window starts after these keys; keep
        # their max finite so that no NaN appears (their weights are 0 until a key is seen).
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(scores - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        if IS_FP32:
            pv = tl.dot(p, values, input_precision="ieee")
        else:
            pv = tl.dot(p.to(values.dtype), values)
        acc = acc * alpha[:, None] + pv
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    if NUM_SPLITS == 1:
        o_off = (q_start + tok).to(tl.int64) * stride_ot + head * stride_oh
        tl.store(out_ptr + o_off[:, None] + d[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & dm[None, :])
    else:  # partials [NUM_SPLITS, T, H, D] (normalised) and [2, NUM_SPLITS, T, H] (max, sum)
        prow = (split * num_tokens + q_start + tok).to(tl.int64) * num_heads + head
        tl.store(part_o_ptr + prow[:, None] * HEAD_DIM + d[None, :], out,
                 mask=row_ok[:, None] & dm[None, :])
        tl.store(part_ml_ptr + prow, m_i, mask=row_ok)
        tl.store(part_ml_ptr + NUM_SPLITS * num_tokens * num_heads + prow, l_i, mask=row_ok)


@triton.jit
def _combine_splits_kernel(part_o_ptr, part_ml_ptr, out_ptr, stride_ot, stride_oh, num_tokens,
                           num_heads, NUM_SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr,
                           BLOCK_D: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    prow = (tl.arange(0, NUM_SPLITS) * num_tokens + t).to(tl.int64) * num_heads + h
    m = tl.load(part_ml_ptr + prow)
    l = tl.load(part_ml_ptr + NUM_SPLITS * num_tokens * num_heads + prow)  # noqa: E741
    m_max = tl.max(m, 0)
    # NOTE: a split that saw no key has max -inf and sum 0: weight 0, and no NaN when every
    # split is empty (a padding row).
    w = l * tl.exp(m - tl.where(m_max == float("-inf"), 0.0, m_max))
    total = tl.sum(w, 0)
    d = tl.arange(0, BLOCK_D)
    dm = d < HEAD_DIM
    parts = tl.load(part_o_ptr + prow[:, None] * HEAD_DIM + d[None, :], mask=dm[None, :],
                    other=0.0)
    out = tl.sum(w[:, None] * parts, 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + t.to(tl.int64) * stride_ot + h * stride_oh + d,
             out.to(out_ptr.dtype.element_ty), mask=dm)


def write_kv_triton(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter new K/V rows ``[T, KVH, D]`` into caches ``[num_blocks, block_size, KVH, D]``."""
    num_tokens, kvh, head_dim = k.shape
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens, kvh)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), k_cache.stride(1),
        k_cache.stride(2), HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim))


def head_dim_tile(head_dim: int) -> int:
    """``BLOCK_D`` of the attention and merge kernels: tl.dot needs an inner dimension of at
    least 16 on GPUs, so smaller head dims run in 16-wide tiles, the rest masked."""
    return max(16, triton.next_power_of_2(head_dim))


@dataclass(frozen=True)
class AttentionLaunch:
    """What one attention launch is compiled for: the kernel's constexprs and ``num_warps``
    (the host-side choices of :func:`paged_attention_triton`, also what
    ``benchmarks/kernel_resources.py`` compiles ahead of time)."""

    group: int
    head_dim: int
    block_m: int
    block_n: int
    is_fp32: bool
    num_splits: int
    num_warps: int
    softcap: float = 0.0

    @property
    def group_p(self) -> int:
        return triton.next_power_of_2(self.group)

    @property
    def block_d(self) -> int:
        return head_dim_tile(self.head_dim)

    @property
    def rows(self) -> int:
        return self.block_m * self.group_p

    def constexprs(self) -> dict[str, int | bool | float]:
        return dict(GROUP=self.group, GROUP_P=self.group_p, HEAD_DIM=self.head_dim,
                    BLOCK_D=self.block_d, BLOCK_M=self.block_m, BLOCK_N=self.block_n,
                    IS_FP32=self.is_fp32, NUM_SPLITS=self.num_splits,
                    SOFTCAP=float(self.softcap))


def attention_launch(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                     max_query_len: int, block_m: int = 16, block_n: int = 64,
                     num_warps: int | None = None, num_splits: int = 1,
                     logit_softcap: float = 0.0) -> AttentionLaunch:
    """The launch :func:`paged_attention_triton` makes for these shapes and knobs."""
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} is not a multiple of "
                         f"num_kv_heads={num_kv_heads}")
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of two >= 16, got {block_n}")
    if num_splits < 1 or num_splits & (num_splits - 1):
        raise ValueError(f"num_splits must be a power of two, got {num_splits}")
    group = num_heads // num_kv_heads
    group_p = triton.next_power_of_2(group)
    # Rows per program: BLOCK_M tokens x the padded group; at least 16 for tl.dot on GPUs.
    bm = max(triton.next_power_of_2(min(block_m, max(max_query_len, 1))),
             max(1, 16 // group_p))
    is_fp32 = dtype == torch.float32
    rows = bm * group_p
    # Register budgets, from compiling launches for sm_90 (benchmarks/kernel_resources.py).
    # A program holds a K and a V tile and their 64-bit addresses. In Triton's general
    # variant (strides not known to be multiples of 16), fp32 tiles of 64 rows or more spill
    # unless keys come 32 at a time, and K tiles of 16 KiB or more (or 64 rows or more) spill
    # with 4 warps but not with 8. The variant Triton specialises for the usual strides
    # (multiples of 16) loads tiles with 16-byte async copies and spills in neither case.
    if is_fp32 and rows >= 64:
        block_n = min(block_n, 32)
    if num_warps is None:
        big = rows >= 64 or block_n * head_dim_tile(head_dim) * dtype.itemsize >= 16384
        num_warps = 8 if big else 4
    return AttentionLaunch(group, head_dim, bm, block_n, is_fp32, num_splits, num_warps,
                           float(logit_softcap))


def paged_attention_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    max_query_len: int | None = None,
    block_m: int = 16,
    block_n: int = 64,
    out: torch.Tensor | None = None,
    num_warps: int | None = None,
    num_splits: int | None = None,
    sliding_window: int = 0,
    logit_softcap: float = 0.0,
) -> torch.Tensor:
    """Write K/V, then attend: ``q`` ``[T, H, D]``, ``k``/``v`` ``[T, KVH, D]`` -> ``[T, H, D]``.

    The arguments are those of :func:`kvflow.plugins.paged_attention_ref.paged_attention_ref`.
    ``max_query_len`` (the most new tokens of any sequence) sizes the launch grid; given, it
    saves a device-to-host copy, which CUDA graphs cannot contain. The cache layout must be
    contiguous ``[num_blocks, block_size, KVH, D]``, K and V alike. ``out`` (``[T, H, D]``,
    any token and head strides) receives the result in place, as a TensorRT plugin's output
    buffer does; every tensor's last dimension must be contiguous.
    ``block_n`` (keys per inner iteration, a power of two >= 16) and ``num_warps`` (default:
    what :func:`attention_launch` picks to keep register spills off Hopper launches) are the
    tuning knobs that ``benchmarks/gpu_check.py`` sweeps. ``num_splits`` (a power of two)
    cuts each program's keys into that many ranges (split KV); by default
    :func:`decode_splits` decides for decode steps on a GPU, and other steps are not split.
    ``sliding_window`` and ``logit_softcap``: the op's attributes (0 = off).
    """
    check_attention_options(sliding_window, logit_softcap)
    num_tokens, num_heads, head_dim = q.shape
    num_blocks, block_size, kvh, _ = k_cache.shape
    if k_cache.stride() != v_cache.stride() or not k_cache.is_contiguous():
        raise ValueError("k_cache and v_cache must be contiguous with the same layout")
    out = torch.empty_like(q) if out is None else out
    for name, t in (("q", q), ("k", k), ("v", v), ("out", out)):
        if t.numel() and t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension, got strides "
                             f"{t.stride()}")
    num_seqs = seq_lens.shape[0]
    if max_query_len is None:
        max_query_len = (int((query_start_loc[1:] - query_start_loc[:-1]).max())
                         if num_seqs else 0)
    if num_splits is None:
        num_splits = decode_splits(num_seqs * kvh, q.device) if max_query_len == 1 else 1
    # Checked before anything is written: bad arguments leave the pool untouched.
    launch = attention_launch(num_heads, kvh, head_dim, k_cache.dtype, max_query_len, block_m,
                              block_n, num_warps, num_splits, logit_softcap)
    write_kv_triton(k, v, k_cache, v_cache, slot_mapping)
    if num_tokens == 0 or num_seqs == 0:
        return out
    grid = (num_seqs, kvh, triton.cdiv(max_query_len, launch.block_m) * num_splits)
    if num_splits > 1:
        part_o = torch.empty((num_splits, num_tokens, num_heads, head_dim),
                             dtype=torch.float32, device=q.device)
        part_ml = torch.empty((2, num_splits, num_tokens, num_heads), dtype=torch.float32,
                              device=q.device)
    else:
        part_o = part_ml = out  # not read: the kernel writes its result directly
    _paged_attention_kernel[grid](
        q, out, k_cache, v_cache, block_tables, seq_lens, query_start_loc, float(scale),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.stride(1),
        k_cache.stride(2), block_tables.stride(0), block_size, part_o, part_ml, num_tokens,
        num_heads, min(sliding_window or NO_WINDOW, NO_WINDOW), **launch.constexprs(),
        num_warps=launch.num_warps)
    if num_splits > 1:
        _combine_splits_kernel[(num_tokens, num_heads)](
            part_o, part_ml, out, out.stride(0), out.stride(1), num_tokens, num_heads,
            NUM_SPLITS=num_splits, HEAD_DIM=head_dim, BLOCK_D=launch.block_d)
    return out


MAX_SPLITS = 16
_sm_counts: dict[int, int] = {}


def decode_splits(programs: int, device: torch.device) -> int:
    """Splits per (sequence, KV head) for a decode launch of ``programs`` of them: about two
    programs per streaming multiprocessor (the power of two at or below what that needs), at
    most ``MAX_SPLITS``; 1 off a GPU (the interpreter gains nothing from splitting)."""
    if device.type != "cuda":
        return 1
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _sm_counts:
        _sm_counts[index] = torch.cuda.get_device_properties(index).multi_processor_count
    want = 2 * _sm_counts[index] // max(programs, 1)
    return min(MAX_SPLITS, 1 << (want.bit_length() - 1)) if want > 1 else 1
