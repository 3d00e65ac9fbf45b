"""Block-quantized weights: a GGUF's own Q4_0 / Q4_1 / Q8_0 blocks, or round-to-nearest of fp32.

A :class:`QuantizedWeight` is a linear layer's ``[out, in]`` weight cut along ``in`` into blocks
of ``block_size``, each with a scale (and, for asymmetric schemes, an integer zero point or a
float minimum)::

    w[n, k] = (q[n, k] - zero_point[n, b]) * scale[n, b] + minimum[n, b],   b = k // block_size

- Q4_0: 4-bit ``q``, zero point 8.          (llama.cpp: ``d * (q - 8)``)
- Q4_1: 4-bit ``q``, zero point 0, minimum. (llama.cpp: ``d * q + m``)
- Q8_0: 8-bit signed ``q``, no zero point.  (llama.cpp: ``d * q``)
- ``int4`` (RTN): 4-bit ``q``, integer zero point from each block's min and max.
- ``int8`` (RTN): 8-bit signed ``q``, symmetric.

:func:`dequantize` reproduces gguf-py's own dequantization bit for bit, which is what HF
transformers loads, so the fp32 and the quantized engine hold the same weights. Pure NumPy.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

GGUF_BLOCK = 32
GGUF_SCHEMES = ("Q4_0", "Q4_1", "Q8_0")
RTN_SCHEMES = ("int4", "int8")
RTN_GROUP_SIZES = (32, 128)


@dataclass
class QuantizedWeight:
    """One ``[out, in]`` weight in blocks along ``in`` (see the module doc for the formula).

    Attributes:
        scheme: ``Q4_0``, ``Q4_1``, ``Q8_0``, ``int4`` or ``int8``.
        bits: 4 or 8.
        block_size: elements per block along ``in``.
        q: ``[out, in]`` codes: uint8 in [0, 15] for 4 bits, int8 for 8 bits.
        scale: float32 ``[out, in // block_size]``.
        zero_point: uint8 ``[out, in // block_size]``, or None for zero.
        minimum: float32 ``[out, in // block_size]`` added after scaling (Q4_1), or None.
    """

    scheme: str
    bits: int
    block_size: int
    q: np.ndarray
    scale: np.ndarray
    zero_point: np.ndarray | None = None
    minimum: np.ndarray | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return self.q.shape  # type: ignore[return-value]

    @property
    def nbytes(self) -> int:
        """Bytes this weight occupies packed (codes, scales, zero points, minima)."""
        out, cols = self.shape
        total = out * cols * self.bits // 8 + self.scale.nbytes
        if self.zero_point is not None:
            total += self.zero_point.size * self.bits // 8
        if self.minimum is not None:
            total += self.minimum.nbytes
        return total

    def rows(self, order: np.ndarray) -> QuantizedWeight:
        """The same weight with its output rows reordered (blocks run along ``in``)."""
        def pick(a: np.ndarray) -> np.ndarray:
            return np.ascontiguousarray(a[order])

        return QuantizedWeight(
            self.scheme, self.bits, self.block_size, pick(self.q), pick(self.scale),
            None if self.zero_point is None else pick(self.zero_point),
            None if self.minimum is None else pick(self.minimum))


def dequantize(w: QuantizedWeight) -> np.ndarray:
    """fp32 ``[out, in]``, computed in gguf-py's order of operations."""
    out, cols = w.shape
    blocks = w.q.reshape(out, cols // w.block_size, w.block_size)
    codes = blocks.astype(np.float32)
    if w.zero_point is not None:
        codes = (blocks.astype(np.int16) - w.zero_point[..., None].astype(np.int16)).astype(
            np.float32)
    values = codes * w.scale[..., None] if w.scheme == "Q8_0" else w.scale[..., None] * codes
    if w.minimum is not None:
        values = values + w.minimum[..., None]
    return values.reshape(out, cols).astype(np.float32)


# --- GGUF blocks ----------------------------------------------------------------------------
def _nibbles(qs: np.ndarray) -> np.ndarray:
    """``[..., 16]`` bytes -> ``[..., 32]`` codes: low nibbles are elements 0-15, high 16-31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def from_gguf_blocks(scheme: str, data: np.ndarray, out: int, cols: int) -> QuantizedWeight:
    """Decode a GGUF tensor's raw bytes (``[out, bytes_per_row]`` uint8) without dequantizing."""
    if scheme not in GGUF_SCHEMES:
        raise ValueError(f"GGUF type {scheme} is not kept quantized (kvflow keeps "
                         f"{GGUF_SCHEMES}); build with --dtype float32")
    nb = cols // GGUF_BLOCK
    raw = np.ascontiguousarray(data).reshape(out, nb, -1)

    def half(lo: int) -> np.ndarray:
        return np.ascontiguousarray(raw[..., lo:lo + 2]).view(np.float16)[..., 0].astype(
            np.float32)

    if scheme == "Q8_0":
        q = np.ascontiguousarray(raw[..., 2:]).view(np.int8).reshape(out, cols)
        return QuantizedWeight(scheme, 8, GGUF_BLOCK, q, half(0))
    if scheme == "Q4_0":
        q = _nibbles(raw[..., 2:]).reshape(out, cols)
        zp = np.full((out, nb), 8, dtype=np.uint8)
        return QuantizedWeight(scheme, 4, GGUF_BLOCK, q, half(0), zero_point=zp)
    q = _nibbles(raw[..., 4:]).reshape(out, cols)
    return QuantizedWeight(scheme, 4, GGUF_BLOCK, q, half(0), minimum=half(2))


# --- round to nearest -----------------------------------------------------------------------
def check_rtn_args(scheme: str, block_size: int) -> None:
    """Refuse a scheme or group size that :func:`quantize_rtn` does not take, by name."""
    if scheme not in RTN_SCHEMES:
        raise ValueError(f"--quantize must be one of {RTN_SCHEMES}, got {scheme!r}")
    if block_size not in RTN_GROUP_SIZES:
        raise ValueError(f"--group-size must be one of {RTN_GROUP_SIZES}, got {block_size}")


def quantize_rtn(w: np.ndarray, scheme: str, block_size: int) -> QuantizedWeight:
    """Round-to-nearest block quantization of an fp32 ``[out, in]`` weight.

    ``int4`` is asymmetric (each block's min..max onto 0..15 with an integer zero point);
    ``int8`` is symmetric (each block's absolute max onto 127).
    """
    check_rtn_args(scheme, block_size)
    out, cols = w.shape
    if cols % block_size:
        raise ValueError(f"a weight of {cols} columns is not a multiple of --group-size "
                         f"{block_size}")
    blocks = w.astype(np.float32).reshape(out, cols // block_size, block_size)
    if scheme == "int8":
        amax = np.abs(blocks).max(axis=-1)
        scale = np.where(amax > 0, amax / 127.0, 1.0).astype(np.float32)
        q = np.clip(np.rint(blocks / scale[..., None]), -127, 127).astype(np.int8)
        return QuantizedWeight(scheme, 8, block_size, q.reshape(out, cols), scale)
    lo = np.minimum(blocks.min(axis=-1), 0.0)
    hi = np.maximum(blocks.max(axis=-1), 0.0)
    scale = np.where(hi > lo, (hi - lo) / 15.0, 1.0).astype(np.float32)
    zp = np.clip(np.rint(-lo / scale), 0, 15).astype(np.uint8)
    q = np.clip(np.rint(blocks / scale[..., None]) + zp[..., None], 0, 15).astype(np.uint8)
    return QuantizedWeight(scheme, 4, block_size, q.reshape(out, cols), scale, zero_point=zp)
