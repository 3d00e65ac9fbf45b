"""The Triton kernels compiled ahead of time for an NVIDIA GPU, on a machine without one.

    python benchmarks/kernel_resources.py --out reports/kernel_resources.json   # ~1 minute
    python benchmarks/kernel_resources.py --arch 80 --quick                     # A100, fewer

Triton's interpreter (how CI runs the kernels) accepts programs that the GPU compiler refuses,
such as a ``tl.dot`` with an inner dimension under 16, and says nothing of shared memory or
registers. This script compiles every launch the runners make, through the same
:func:`~kvflow.plugins.paged_attention_triton.attention_launch` choices, for a GPU
architecture with the ``ptxas`` that ships in the triton wheel: decode steps (with and without
split KV) and prefill steps, for the model shapes kvflow serves or benchmarks, in fp32, fp16
and bf16; the KV write and the split merge; and the settings ``gpu_check.py`` sweeps.

For each it reports the shared memory, registers and stack (spill) bytes per thread, and it
fails when a launch does not compile or needs more shared memory than a block may have on
that architecture. Integer arguments are specialised as a GPU run specialises them: those
divisible by 16 (strides of the model's shapes, 16-token blocks, block tables 128 wide) are
compiled as such, which is what lets Triton issue 16-byte asynchronous copies for the K/V
tiles; the ``vec16`` column counts those instructions (16-byte loads) in the kernel's PTX.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if os.environ.get("TRITON_INTERPRET") == "1":  # compiled kernels, not interpreted ones
    del os.environ["TRITON_INTERPRET"]
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvflow.plugins import paged_attention_triton as pat  # noqa: E402

# Most dynamic shared memory one block may use (CUDA programming guide, compute capabilities).
MAX_SHARED = {80: 166912, 86: 101376, 89: 101376, 90: 232448}
# (query heads, KV heads, head dim) of the models kvflow serves, tests or benchmarks.
SHAPES = {
    "Llama-3-8B": (32, 8, 128),
    "Llama 1B (gpu_check)": (32, 4, 64),
    "SmolLM2-135M (default)": (9, 3, 64),
    "tiny test models": (8, 2, 8),
}
TRITON_TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def attention_signature(launch: pat.AttentionLaunch, dtype: torch.dtype
                        ) -> tuple[dict[str, str], dict[str, Any]]:
    names = pat._paged_attention_kernel.arg_names
    t = f"*{TRITON_TYPES[dtype]}"
    part = "*fp32" if launch.num_splits > 1 else t
    types = dict(q_ptr=t, out_ptr=t, k_cache_ptr=t, v_cache_ptr=t, block_tables_ptr="*i32",
                 seq_lens_ptr="*i32", qsl_ptr="*i32", scale="fp32", part_o_ptr=part,
                 part_ml_ptr=part)
    constexprs = launch.constexprs()
    return ({n: "constexpr" if n in constexprs else types.get(n, "i32") for n in names},
            constexprs)


def shape_ints(heads: int, kv_heads: int, head_dim: int) -> dict[str, int]:
    """The integer arguments the runners pass for a model shape (strides in elements)."""
    return dict(stride_qt=heads * head_dim, stride_qh=head_dim, stride_ot=heads * head_dim,
                stride_oh=head_dim, stride_cache_slot=kv_heads * head_dim,
                stride_cache_h=head_dim, stride_bt=128, block_size=16,
                stride_kt=kv_heads * head_dim, stride_kh=head_dim,
                stride_vt=kv_heads * head_dim, stride_vh=head_dim)


def compile_kernel(fn: Any, signature: dict[str, str], constexprs: dict[str, Any],
                   num_warps: int, arch: int, ints: dict[str, int] | None = None) -> Any:
    names = fn.arg_names
    # Pointers from torch's allocator are 16-byte aligned, and integers divisible by 16 are
    # marked so, as Triton's launcher specialises them at run time.
    aligned = [n for n, t in signature.items() if t.startswith("*")]
    aligned += [n for n, v in (ints or {}).items() if n in signature and v % 16 == 0]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    src = ASTSource(fn, signature, constexprs, attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32),
                          options=dict(num_warps=num_warps))


def resources(kernel: Any) -> dict[str, int]:
    """Registers and stack bytes per thread (cuobjdump), and shared memory (Triton's)."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        dump = subprocess.run([str(tool), "--dump-resource-usage", f.name],
                              capture_output=True, text=True, check=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+)", dump)
    if m is None:
        raise RuntimeError(f"no resource usage in cuobjdump's output: {dump[-300:]}")
    ptx = kernel.asm["ptx"]
    vec16 = len(re.findall(r"cp\.async\.cg\.shared\.global|ld\.global[.\w]*\.v4\.", ptx))
    return {"shared": int(kernel.metadata.shared), "registers": int(m.group(1)),
            "stack": int(m.group(2)), "vec16": vec16}


Launch = tuple[str, Any, dict[str, str], dict[str, Any], int, dict[str, int]]


def launches(quick: bool) -> list[Launch]:
    """(label, kernel, signature, constexprs, num_warps, integer arguments) of every launch
    to compile."""
    out = []
    shapes = {k: SHAPES[k] for k in ("Llama-3-8B", "tiny test models")} if quick else SHAPES
    for model, (heads, kv_heads, head_dim) in shapes.items():
        ints = shape_ints(heads, kv_heads, head_dim)
        dtypes = [torch.bfloat16, torch.float32] if quick else [torch.bfloat16, torch.float16,
                                                                torch.float32]
        for dtype in dtypes:
            name = TRITON_TYPES[dtype]
            for kind, max_query_len, splits in (("decode", 1, 1), ("decode split 16", 1, 16),
                                                ("prefill", 512, 1)):
                launch = pat.attention_launch(heads, kv_heads, head_dim, dtype, max_query_len,
                                              num_splits=splits)
                sig, cx = attention_signature(launch, dtype)
                out.append((f"{model} {name} {kind}: attention", pat._paged_attention_kernel,
                            sig, cx, launch.num_warps, ints))
            t = f"*{name}"
            out.append((f"{model} {name}: KV write", pat._write_kv_kernel,
                        dict(k_ptr=t, v_ptr=t, k_cache_ptr=t, v_cache_ptr=t, slot_ptr="*i64",
                             stride_kt="i32", stride_kh="i32", stride_vt="i32",
                             stride_vh="i32", stride_cache_slot="i32", stride_cache_h="i32",
                             HEAD_DIM="constexpr", BLOCK_D="constexpr"),
                        dict(HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim)), 4,
                        ints))
            block_d = pat.head_dim_tile(head_dim)
            out.append((f"{model} {name}: split merge", pat._combine_splits_kernel,
                        dict(part_o_ptr="*fp32", part_ml_ptr="*fp32", out_ptr=t,
                             stride_ot="i32", stride_oh="i32", num_tokens="i32",
                             num_heads="i32", NUM_SPLITS="constexpr", HEAD_DIM="constexpr",
                             BLOCK_D="constexpr"),
                        dict(NUM_SPLITS=16, HEAD_DIM=head_dim, BLOCK_D=block_d), 4, ints))
    if not quick:  # gpu_check's bandwidth sweep: Llama-3-8B decode, bf16
        for block_n, warps in ((32, 4), (64, 4), (128, 4), (64, 8), (128, 8)):
            launch = pat.attention_launch(32, 8, 128, torch.bfloat16, 1, block_n=block_n,
                                          num_warps=warps)
            sig, cx = attention_signature(launch, torch.bfloat16)
            out.append((f"sweep block_n={block_n} num_warps={warps}: attention",
                        pat._paged_attention_kernel, sig, cx, warps, shape_ints(32, 8, 128)))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", type=int, default=90, choices=sorted(MAX_SHARED),
                   help="compute capability x 10 (90: H100/H200, 80: A100)")
    p.add_argument("--quick", action="store_true",
                   help="two model shapes, bf16 and fp32, no sweep (what CI compiles)")
    p.add_argument("--out", default="reports/kernel_resources.json")
    args = p.parse_args()
    todo = launches(args.quick)
    rows, failed = [], 0
    t0 = time.perf_counter()
    for i, (label, fn, sig, cx, warps, ints) in enumerate(todo, 1):
        print(f"[{i}/{len(todo)}] {label}", file=sys.stderr, flush=True)
        row: dict[str, Any] = {"launch": label, "num_warps": warps}
        try:
            row.update(resources(compile_kernel(fn, sig, cx, warps, args.arch, ints)))
            if row["shared"] > MAX_SHARED[args.arch]:
                row["error"] = (f"needs {row['shared']} bytes of shared memory, over sm_"
                                f"{args.arch}'s {MAX_SHARED[args.arch]}")
        except Exception as e:  # noqa: BLE001  report every launch, then fail
            row["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:300]}"
        failed += "error" in row
        rows.append(row)
    report = {"arch": f"sm_{args.arch}", "triton": triton.__version__,
              "compile_s": time.perf_counter() - t0, "launches": rows}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    width = max(len(r["launch"]) for r in rows)
    print(f"{'launch':<{width}}  warps  shared  regs  stack  vec16  (sm_{args.arch}, triton "
          f"{triton.__version__})")
    for r in rows:
        if "error" in r:
            print(f"{r['launch']:<{width}}  {r['num_warps']:>5}  FAILED: {r['error']}")
        else:
            print(f"{r['launch']:<{width}}  {r['num_warps']:>5}  {r['shared']:>6}  "
                  f"{r['registers']:>4}  {r['stack']:>5}  {r['vec16']:>5}")
    print(f"{len(rows) - failed}/{len(rows)} launches compiled within sm_{args.arch}'s limits; "
          f"report in {out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
