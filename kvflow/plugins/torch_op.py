"""``torch.ops.kvflow.paged_attention``: the PagedAttention custom op, and its ONNX export.

Eagerly the op runs the PyTorch reference on the host pool registered at ``kv_cache_ptrs``,
or the OpenAI Triton kernels on a device pool (``kv_registry.register_device``).
Under ``torch.onnx.export(dynamo=True)`` it becomes exactly one node ``PagedAttention`` in the
custom domain ``kvflow`` (no dot: TensorRT maps the domain to a plugin namespace), with the
attributes below. The node's inputs and attributes are the engine I/O contract of one layer.

``sliding_window`` and ``logit_softcap`` are optional (0 = off, also when a node written before
they existed lacks them): a query at position ``p`` then sees keys at ``p - sliding_window < j
<= p`` only, and its scores ``s = (q.k) * scale`` become ``logit_softcap * tanh(s /
logit_softcap)`` before the softmax (Gemma 2). Every implementation skips the block-table
entries of blocks wholly before the window of a sequence's earliest query in the step: the KV
manager may have released them (replaced by block 0, whose contents are anything).
"""

from __future__ import annotations

import torch
from onnx import helper
from onnx.defs import OpSchema

from kvflow.plugins import kv_registry
from kvflow.plugins.op_names import ONNX_DOMAIN, ONNX_OP_TYPE, ONNX_OP_VERSION
from kvflow.plugins.paged_attention_ref import paged_attention_ref

_INPUTS = [
    ("q", "T", "[num_tokens, num_heads*head_dim] queries, RoPE applied"),
    ("k", "T", "[num_tokens, num_kv_heads*head_dim] new keys, RoPE applied"),
    ("v", "T", "[num_tokens, num_kv_heads*head_dim] new values"),
    ("kv_cache_ptrs", "tensor(int64)", "[num_layers, 2] K and V pool base addresses per layer"),
    ("slot_mapping", "tensor(int64)", "[num_tokens] pool slot of each new token, -1 = skip"),
    ("block_tables", "tensor(int32)", "[num_seqs, max_blocks] block ids, padded with block 0"),
    ("seq_lens", "tensor(int32)", "[num_seqs] tokens of each sequence after this step"),
    ("query_start_loc", "tensor(int32)", "[num_seqs+1] offsets of each sequence's new tokens"),
]
_ATTRS = [
    ("layer_idx", OpSchema.AttrType.INT),
    ("num_heads", OpSchema.AttrType.INT),
    ("num_kv_heads", OpSchema.AttrType.INT),
    ("head_dim", OpSchema.AttrType.INT),
    ("block_size", OpSchema.AttrType.INT),
    ("scale", OpSchema.AttrType.FLOAT),
]
# Optional attributes, with the value meaning "off" as their default (graphs exported before
# they existed lack them).
_OPTIONAL_ATTRS = [
    ("sliding_window", helper.make_attribute("sliding_window", 0),
     "keys visible to a query at position p: p - sliding_window < j <= p; 0 = all up to p"),
    ("logit_softcap", helper.make_attribute("logit_softcap", 0.0),
     "scores s become logit_softcap * tanh(s / logit_softcap) before the softmax; 0 = off"),
]

PAGED_ATTENTION_SCHEMA = OpSchema(
    ONNX_OP_TYPE,
    ONNX_DOMAIN,
    ONNX_OP_VERSION,
    doc="Write new K/V into the paged pool, then causal attention over each sequence's blocks.",
    inputs=[OpSchema.FormalParameter(n, t, d) for n, t, d in _INPUTS],
    outputs=[OpSchema.FormalParameter("out", "T", "[num_tokens, num_heads*head_dim]")],
    type_constraints=[
        ("T", ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"], "activation dtype")
    ],
    attributes=[*(OpSchema.Attribute(n, t, n) for n, t in _ATTRS),
                *(OpSchema.Attribute(n, default, doc) for n, default, doc in _OPTIONAL_ATTRS)],
)


def _host_cache(addr: int) -> torch.Tensor:
    return torch.from_numpy(kv_registry.lookup(addr))


@torch.library.custom_op("kvflow::paged_attention", mutates_args=())
def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache_ptrs: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    layer_idx: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    scale: float,
    sliding_window: int = 0,
    logit_softcap: float = 0.0,
) -> torch.Tensor:
    """Write K/V into the registered pool of ``layer_idx``, then attend (see module doc): a
    device pool runs the Triton kernels, a host pool the PyTorch reference."""
    # NOTE: the op writes into memory outside its arguments (the pool, reached by address). That
    # is the contract TensorRT's plugin follows too; the output depends on the write, so no
    # compiler can drop or reorder it relative to this layer's attention.
    t = q.shape[0]
    k_addr, v_addr = (int(a) for a in kv_cache_ptrs[layer_idx])
    args = (q.view(t, num_heads, head_dim), k.view(t, num_kv_heads, head_dim),
            v.view(t, num_kv_heads, head_dim))
    k_dev = kv_registry.lookup_device(k_addr)
    if k_dev is not None:  # a device pool: the Triton kernels
        from kvflow.plugins.paged_attention_triton import paged_attention_triton

        v_dev = kv_registry.lookup_device(v_addr)
        if v_dev is None:  # a layer's K and V pools are registered together
            raise KeyError(f"kv_cache_ptrs holds a device K pool but V address {v_addr:#x}, "
                           "which is no registered device pool")
        out = paged_attention_triton(*args, k_dev, v_dev,
                                     slot_mapping, block_tables, seq_lens, query_start_loc,
                                     scale, max_query_len=kv_registry.max_query_len_hint(),
                                     sliding_window=sliding_window,
                                     logit_softcap=logit_softcap)
    else:
        out = paged_attention_ref(*args, _host_cache(k_addr), _host_cache(v_addr),
                                  slot_mapping, block_tables, seq_lens, query_start_loc, scale,
                                  sliding_window=sliding_window, logit_softcap=logit_softcap)
    return out.view(t, num_heads * head_dim)


@paged_attention.register_fake
def _(q, k, v, kv_cache_ptrs, slot_mapping, block_tables, seq_lens, query_start_loc,
      layer_idx, num_heads, num_kv_heads, head_dim, block_size, scale, sliding_window=0,
      logit_softcap=0.0):
    return torch.empty_like(q)


def onnx_translation_table() -> dict:
    """``custom_translation_table`` for ``torch.onnx.export(dynamo=True)``."""
    import onnxscript

    opset = onnxscript.values.Opset(ONNX_DOMAIN, ONNX_OP_VERSION)
    node = onnxscript.values.Op(opset, ONNX_OP_TYPE, PAGED_ATTENTION_SCHEMA)

    def paged_attention_onnx(q, k, v, kv_cache_ptrs, slot_mapping, block_tables, seq_lens,
                             query_start_loc, layer_idx: int, num_heads: int,
                             num_kv_heads: int, head_dim: int, block_size: int, scale: float,
                             sliding_window: int = 0, logit_softcap: float = 0.0):
        # NOTE: both optional attributes are always written: TensorRT's Python plugins take no
        # attribute defaults, so its plugin declares them and every node must carry them.
        return node(q, k, v, kv_cache_ptrs, slot_mapping, block_tables, seq_lens,
                    query_start_loc, layer_idx=layer_idx, num_heads=num_heads,
                    num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size,
                    scale=scale, sliding_window=int(sliding_window),
                    logit_softcap=float(logit_softcap))

    return {torch.ops.kvflow.paged_attention.default: paged_attention_onnx}
