"""Decode steps replayed from CUDA graphs, one graph per batch-size bucket.

A decode step (every running sequence adds one token and has it sampled) is, once its batch
size is fixed, the same sequence of kernel launches every time: only the contents of a few
small inputs change. Launched one by one from Python, a 1B-parameter model's few hundred kernels
cost more CPU time than the GPU spends on them; replayed from a captured CUDA graph they cost
one launch. This is what vLLM and TensorRT-LLM do for decode.

:class:`DecodeGraphs` keeps static input buffers sized for the largest bucket and, per bucket
``b``, the model's forward captured over the first ``b`` rows. A step of ``S`` sequences runs
in the smallest bucket ``b >= S``; the ``b - S`` padding rows are sequences with no context
(``seq_len`` 0, so attention reads nothing; slot -1, so nothing is written; token 0 at
position 0), whose logits are dropped. ``query_start_loc`` and ``logits_indices`` of a decode
step are ``0..b`` and ``0..b-1``: they are filled once.

Without CUDA (the Triton interpreter in CI) the same buffers and padding run eagerly, so
everything but the capture itself is checked on the CPU; ``benchmarks/gpu_check.py`` and
``tests/test_gpu_path.py`` check the captured graphs against eager steps on a GPU.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvflow.plugins import kv_registry
from kvflow.runtime.base import StepInput


def decode_batch_sizes(max_batch_size: int) -> list[int]:
    """The buckets: 1, 2, 4, then every multiple of 8, up to and including
    ``max_batch_size`` (at most 7 padding rows per step past 8 sequences)."""
    sizes = [b for b in (1, 2, 4) if b < max_batch_size]
    sizes += list(range(8, max_batch_size, 8))
    return [*sizes, max_batch_size]


class DecodeGraphs:
    """Decode steps of up to ``max(sizes)`` sequences, replayed from captured CUDA graphs.

    Args:
        forward: the step model, called as the runner calls it (``input_ids, positions,
            slot_mapping, block_tables, seq_lens, query_start_loc, logits_indices``; the KV
            pool bound already); it must not synchronise with the host.
        device: where the static buffers live.
        sizes: the batch-size buckets (see :func:`decode_batch_sizes`).
        max_blocks: block-table width, ``ceil(max_model_len / block_size)``.
        capture: capture CUDA graphs (a CUDA device); False runs the same padded static
            buffers eagerly.
    """

    def __init__(self, forward: Callable[..., torch.Tensor], device: torch.device,
                 sizes: list[int], max_blocks: int, capture: bool) -> None:
        if not sizes or min(sizes) < 1:
            raise ValueError(f"decode graph batch sizes must be >= 1, got {sizes}")
        self.sizes = sorted(set(sizes))
        self.max_blocks = max_blocks
        self.captured = capture
        self._forward = forward
        n = self.sizes[-1]
        pin = device.type == "cuda"

        def host(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, pin_memory=pin)

        # Per step: token, position, slot, seq_len per row (int64 and int32 staging) and the
        # block tables; host staging (pinned on CUDA) and their device twins.
        self._h64 = host((3, n), torch.int64)
        self._h_lens = host((n,), torch.int32)
        self._h_tables = host((n, max_blocks), torch.int32)
        self._d64 = self._h64.to(device)
        self._d_lens = self._h_lens.to(device)
        self._d_tables = self._h_tables.to(device)
        self._qsl = torch.arange(n + 1, dtype=torch.int32, device=device)
        self._rows = torch.arange(n, dtype=torch.int64, device=device)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # Marks the last copies out of the staging buffers: the next step waits for it before
        # overwriting them (a caller that does not read the logits back would race otherwise).
        self._copied = torch.cuda.Event() if pin else None
        if capture:
            self._capture_all()

    def _run(self, b: int) -> torch.Tensor:
        ids, pos, slots = self._d64[:, :b]
        with kv_registry.step_hints(max_query_len=1):
            return self._forward(ids, pos, slots, self._d_tables[:b], self._d_lens[:b],
                                 self._qsl[:b + 1], self._rows[:b])

    def _capture_all(self) -> None:
        # Padding rows everywhere: warm-up and capture write nothing to the pool.
        self._h64[2].fill_(-1)
        self._d64.copy_(self._h64)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # compile the kernels, pick cuBLAS algorithms
            for b in self.sizes:
                vocab = self._run(b).shape[1]
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        # Every graph writes its logits into rows of one buffer, so that only one
        # [max batch, vocab] output stays allocated; the activations of all graphs share one
        # memory pool, captured largest first so that the smaller ones fit in its memory.
        self._logits = torch.empty((self.sizes[-1], vocab), dtype=torch.float32,
                                   device=self._d64.device)
        mempool = None
        for b in reversed(self.sizes):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=mempool):
                self._logits[:b].copy_(self._run(b))
            mempool = graph.pool()
            self._graphs[b] = graph
        torch.cuda.synchronize()

    def bucket(self, step: StepInput) -> int | None:
        """The bucket a step runs in, or None when it is not a decode step that fits."""
        if not step.is_decode or step.block_tables.shape[1] > self.max_blocks:
            return None
        s = step.num_seqs
        return next((b for b in self.sizes if b >= s), None)

    @torch.inference_mode()
    def run(self, step: StepInput, b: int) -> torch.Tensor:
        """Logits ``[S, vocab]`` (on the device) of a decode step in bucket ``b``."""
        s = step.num_seqs
        if self._copied is not None:
            self._copied.synchronize()
        h = self._h64
        h[0, :s] = torch.from_numpy(step.input_ids)
        h[1, :s] = torch.from_numpy(step.positions)
        h[2, :s] = torch.from_numpy(step.slot_mapping)
        h[:2, s:b] = 0
        h[2, s:b] = -1
        self._h_lens[:s] = torch.from_numpy(step.seq_lens)
        self._h_lens[s:b] = 0
        w = step.block_tables.shape[1]
        self._h_tables[:s, :w] = torch.from_numpy(step.block_tables)
        self._d64.copy_(h, non_blocking=True)  # whole (3, n): one contiguous copy
        self._d_lens[:b].copy_(self._h_lens[:b], non_blocking=True)
        self._d_tables[:b].copy_(self._h_tables[:b], non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        if self.captured:
            self._graphs[b].replay()
            return self._logits[:s]
        return self._run(b)[:s]

    def close(self) -> None:
        self._graphs.clear()
