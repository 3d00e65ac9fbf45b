"""The multi-LoRA product as OpenAI Triton kernels: the GPU path of the PyTorch runner's LoRA
(the same result as :func:`kvflow.plugins.lora_torch.lora_apply` and ``kvflow::LoraMatMul``).

For one linear, tokens of different adapters in one launch (Punica's BGMV/SGMV, S-LoRA), over
the slot pool of :mod:`kvflow.runtime.lora_pool` (one module: ``A [slots, max_rank, in]``,
``Bt [slots, max_rank, out]``, ``ranks [slots]``), in two launches:

1. ``_shrink_kernel``: one program per token computes ``u = A[s, :r] x`` (``r`` rows, the
   token's slot's rank for this module, in fp32), ``BLOCK_K`` input features at a time; tokens
   of the base model (slot -1) or of a slot without this module (rank 0) leave ``u`` zero.
2. ``_expand_kernel``: one program per (token, ``BLOCK_N`` output columns) adds
   ``u . Bt[s, :r, cols]`` to the token's output row, in fp32, stored in the output's dtype;
   programs of tokens with nothing to add return at once.

The slot of each token is read on the device, so a step's launches never synchronise with the
host (a CUDA graph could hold them). On a machine without CUDA the kernels run in Triton's
interpreter (``TRITON_INTERPRET=1``, set before triton is imported), as the tests run them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_K = 128
BLOCK_N = 128


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, ranks_ptr, slots_ptr, u_ptr, K, stride_x, MAX_RANK,
                   R: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    s = tl.load(slots_ptr + t)
    if s >= 0:
        r = tl.load(ranks_ptr + s)
        if r > 0:
            rows = tl.arange(0, R)
            acc = tl.zeros([R], dtype=tl.float32)
            base = a_ptr + s.to(tl.int64) * MAX_RANK * K
            for k0 in range(0, K, BLOCK):
                ks = k0 + tl.arange(0, BLOCK)
                x = tl.load(x_ptr + t * stride_x + ks, mask=ks < K, other=0.0).to(tl.float32)
                a = tl.load(base + rows[:, None] * K + ks[None, :],
                            mask=(rows[:, None] < r) & (ks[None, :] < K), other=0.0)
                acc += tl.sum(a.to(tl.float32) * x[None, :], axis=1)
            tl.store(u_ptr + t * R + rows, acc)


@triton.jit
def _expand_kernel(u_ptr, bt_ptr, ranks_ptr, slots_ptr, y_ptr, N, stride_y, MAX_RANK,
                   R: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    nb = tl.program_id(1)
    s = tl.load(slots_ptr + t)
    if s >= 0:
        r = tl.load(ranks_ptr + s)
        if r > 0:
            rows = tl.arange(0, R)
            cols = nb * BLOCK + tl.arange(0, BLOCK)
            u = tl.load(u_ptr + t * R + rows)
            bt = tl.load(bt_ptr + s.to(tl.int64) * MAX_RANK * N + rows[:, None] * N
                         + cols[None, :], mask=(rows[:, None] < r) & (cols[None, :] < N),
                         other=0.0)
            delta = tl.sum(bt.to(tl.float32) * u[:, None], axis=0)
            y = tl.load(y_ptr + t * stride_y + cols, mask=cols < N, other=0.0)
            tl.store(y_ptr + t * stride_y + cols,
                     (y.to(tl.float32) + delta).to(y_ptr.dtype.element_ty), mask=cols < N)


def lora_apply_triton(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, bt: torch.Tensor,
                      ranks: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """``y`` ``[T, N]`` plus each token's LoRA product (a new tensor; ``y`` is not modified).
    ``x`` ``[T, K]``; ``a`` fp32 ``[slots, max_rank, K]``, ``bt`` fp32 ``[slots, max_rank, N]``,
    ``ranks`` int32 ``[slots]``; ``slots`` int32 ``[T]`` (-1: the base model). All on one
    device."""
    t, n = y.shape
    k = x.shape[1]
    max_rank = a.shape[1]
    if a.shape[2] != k or bt.shape[1] != max_rank or bt.shape[2] != n or slots.shape != (t,):
        raise ValueError(f"LoRA shapes do not fit: y {tuple(y.shape)}, x {tuple(x.shape)}, "
                         f"A {tuple(a.shape)}, Bt {tuple(bt.shape)}, slots {tuple(slots.shape)}")
    out = y.contiguous().clone()
    if t == 0:
        return out
    x = x.contiguous()
    r_pad = max(16, triton.next_power_of_2(max_rank))
    u = torch.zeros((t, r_pad), dtype=torch.float32, device=y.device)
    _shrink_kernel[(t,)](x, a, ranks, slots, u, k, x.stride(0), max_rank, R=r_pad,
                         BLOCK=BLOCK_K)
    _expand_kernel[(t, triton.cdiv(n, BLOCK_N))](u, bt, ranks, slots, out, n, out.stride(0),
                                                 max_rank, R=r_pad, BLOCK=BLOCK_N)
    return out
