"""The names of kvflow's PagedAttention node in an ONNX graph (the engine I/O contract), in a
module of their own so that what only reads graphs (the ONNX Runtime runner) imports no torch."""

ONNX_DOMAIN = "kvflow"  # no dot: TensorRT maps the domain to a plugin namespace
ONNX_OP_TYPE = "PagedAttention"
ONNX_OP_VERSION = 1
