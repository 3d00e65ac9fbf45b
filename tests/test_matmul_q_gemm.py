"""kvflow::MatMulQ's tiled int8 GEMM (kvflow/plugins/matmul_q_gemm.h), which runs steps of 8
(AVX2 Q8_0: 16) rows or more, and its row kernels, on every ISA variant of the op library this
CPU runs (each its own library, loaded side by side): against the NumPy reference of the op's
arithmetic (tests/test_matmul_q_op.py) at odd shapes and tails (rows not a multiple of the row
group, columns not a multiple of the 16-column tile, K = 32 and K large, many rows), bits
4 and 8, one thread and ORT's pool; and the ISA selection itself: KVFLOW_ISA forces a variant,
one the CPU lacks is refused by name."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import numpy as np
import pytest

from kvflow.plugins import ort_custom_ops, ort_isa
from tests.test_matmul_q_op import (
    SAME_ARITHMETIC_TOL,
    inputs,
    make_weight,
    matmul_q_model,
    needs_library,
    reference,
    session,
)

RUNNABLE = ort_isa.runnable()
# (M, K, N): rows past the 8- and 4-row groups, columns past the 16-column tile, one block
# (K = 32), a long K; M = 8 and 16 are the GEMM's smallest steps; 397 and 520 many rows.
SHAPES = [(16, 32, 17), (37, 576, 49), (67, 96, 16), (131, 1024, 33), (19, 4096, 8),
          (23, 160, 1), (8, 64, 40), (9, 32, 3), (397, 64, 24), (520, 32, 17)]
BLOCK_TAIL = 32


def _library(isa: str):
    path = ort_custom_ops.library(isa=isa)
    assert path is not None, ort_custom_ops.unavailable_reason(isa=isa)
    return path


@needs_library
@pytest.mark.parametrize("isa", RUNNABLE)
@pytest.mark.parametrize("scheme", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize("m,k,n", SHAPES)
def test_gemm_equals_the_reference_on_every_isa(isa, scheme, m, k, n):
    weight = make_weight(scheme, k, n, seed=m)
    x = inputs(m, k, seed=n)
    x[2, -BLOCK_TAIL:] *= 1e3  # a block of large values (and inputs() makes one of zeros)
    ref = reference(x, weight)
    for threads, attrs in ((1, {}), (2, {"parallel_min_work": 0})):
        y = session(matmul_q_model(weight, **attrs), _library(isa), threads).run(
            None, {"x": x})[0]
        assert y.shape == (m, n)
        np.testing.assert_allclose(y, ref, rtol=0, atol=SAME_ARITHMETIC_TOL * np.abs(ref).max(),
                                   err_msg=f"{isa} {scheme} M={m} K={k} N={n} threads={threads}")


@needs_library
@pytest.mark.parametrize("isa", RUNNABLE)
def test_gemm_and_row_kernels_agree_across_the_switch(isa):
    """Rows computed alone (the row kernels, M < 8) equal the same rows inside a GEMM step."""
    for scheme in ("Q4_1", "Q8_0"):
        weight = make_weight(scheme, 320, 40)
        x = inputs(40, 320)
        s = session(matmul_q_model(weight), _library(isa))
        full = s.run(None, {"x": x})[0]
        for r0 in (0, 8, 32):
            part = s.run(None, {"x": x[r0:r0 + 5]})[0]
            np.testing.assert_allclose(part, full[r0:r0 + 5], rtol=0,
                                       atol=SAME_ARITHMETIC_TOL * np.abs(full).max())


@needs_library
def test_every_variant_says_what_it_is():
    for isa in RUNNABLE:
        assert ort_custom_ops.native_isa(isa) == isa
        assert ort_custom_ops.native_gemm(isa) == (isa != "portable")
    assert ort_custom_ops.native_isa() == ort_isa.select()


def _in_subprocess(isa: str) -> subprocess.CompletedProcess:
    code = ("from kvflow.plugins import ort_custom_ops as o; "
            "print(o.native_isa(), o.native_gemm(), o.unavailable_reason())")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, ort_isa.ENV: isa}, check=True)


@needs_library
def test_kvflow_isa_forces_a_variant():
    assert _in_subprocess(RUNNABLE[-1]).stdout.split()[:2] == [RUNNABLE[-1], "False"]
    if "avx2" in RUNNABLE:
        assert _in_subprocess("avx2").stdout.split()[:2] == ["avx2", "True"]


@pytest.mark.skipif(not ort_isa.is_x86(), reason="ISA variants: x86 only")
def test_an_isa_the_cpu_lacks_or_unknown_is_refused_by_name():
    lacking = [isa for isa in ort_isa.ISAS if isa not in RUNNABLE]
    for isa in lacking:
        with pytest.raises(ort_isa.IsaUnavailable, match=f"KVFLOW_ISA={isa}: this CPU .* lacks"):
            ort_isa.select(isa)
        assert ort_custom_ops.library(isa=isa) is None
        assert f"KVFLOW_ISA={isa}" in (ort_custom_ops.unavailable_reason(isa=isa) or "")
    with pytest.raises(ort_isa.IsaUnavailable, match="KVFLOW_ISA=sse9 is none of avx512vnni"):
        ort_isa.select("sse9")


@needs_library
@pytest.mark.parametrize("isa", RUNNABLE)
@pytest.mark.parametrize("scheme", ["Q4_1", "Q8_0"])
def test_row_kernels_equal_the_reference_on_every_isa(isa, scheme):
    """Steps below the GEMM (a decode step: one row, AVX-512's two blocks a vector) at block
    counts odd, below, at and past the 16- and 32-block chunks."""
    for k in (32, 96, 608, 1056, 1536):
        weight = make_weight(scheme, k, 9, seed=k)
        s = session(matmul_q_model(weight), _library(isa))
        for m in (1, 2, 3, 5):
            x = inputs(m, k, seed=m)
            ref = reference(x, weight)
            np.testing.assert_allclose(s.run(None, {"x": x})[0], ref, rtol=0,
                                       atol=SAME_ARITHMETIC_TOL * np.abs(ref).max(),
                                       err_msg=f"{isa} {scheme} M={m} K={k}")


def test_the_library_name_hashes_every_source_it_includes():
    """The cache key is honest: every local header the library includes is in SOURCES."""
    folder = ort_custom_ops.SOURCE.parent
    included = set()
    for source in [ort_custom_ops.SOURCE, *folder.glob("*.h")]:
        included |= set(re.findall(r'#include "([^"]+)"', source.read_text()))
    assert included <= {s.name for s in ort_custom_ops.SOURCES}


@needs_library
@pytest.mark.skipif("avx512vnni" not in RUNNABLE or "avxvnni" in RUNNABLE,
                    reason="AVX-VNNI's code path through AVX-512 VNNI's 256-bit instruction")
def test_the_avx_vnni_code_path_through_avx512_vl(tmp_path):
    """This CPU lacks AVX-VNNI: its 256-bit GEMM path (matmul_q_gemm_x86.h, KVFLOW_VNNI256)
    runs here in a build with AVX-512 VNNI on 256 bits (VL) and no AVX-512 BW (so no 512-bit
    GEMM), the same arithmetic with the same instruction's AVX-512 encoding."""
    library = tmp_path / "vnni256.so"
    flags = [*ort_custom_ops.CXX_FLAGS, "-march=x86-64-v3", "-mavx512vl", "-mavx512vnni",
             '-DKVFLOW_ISA_NAME="vnni256"']
    subprocess.run(["g++", *flags, f"-I{ort_custom_ops.find_headers()}", "-o", str(library),
                    str(ort_custom_ops.SOURCE)], check=True, capture_output=True)
    for scheme in ("Q4_1", "Q8_0"):
        for m, k, n in SHAPES[:6]:
            weight = make_weight(scheme, k, n, seed=m)
            x = inputs(m, k, seed=n)
            ref = reference(x, weight)
            y = session(matmul_q_model(weight), library).run(None, {"x": x})[0]
            np.testing.assert_allclose(y, ref, rtol=0,
                                       atol=SAME_ARITHMETIC_TOL * np.abs(ref).max(),
                                       err_msg=f"{scheme} M={m} K={k} N={n}")
