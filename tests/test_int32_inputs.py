"""Integer inputs sent as INT32 (clients written for TensorRT-LLM's ensemble) and as INT64 (kvflow's
own, and HTTP JSON) against a real tritonserver (issue 31, part 4).

The inputs are declared INT64, so that Triton's HTTP JSON parser, which wraps a value that does
not fit a 32-bit input (2**32 + 5 becomes 5), never gets to; ``kvflow serve``'s preload library
widens an INT32 tensor for them to INT64 on the way in (``kvflow/triton_backend/preload.c``).
"""

from __future__ import annotations

import queue
import threading
from pathlib import Path

import numpy as np
import pytest

from kvflow.client import infer_inputs
from kvflow.triton_backend.preload import int64_inputs
from tests.helpers import DEADLINE_S, post

CONFIG = Path(__file__).resolve().parents[1] / "model_repository" / "kvflow" / "config.pbtxt"
# The integer inputs the backend reads (params.py), and what TensorRT-LLM's ensemble declares
# INT32 among them.
INTEGER_INPUTS = {"input_ids", "max_tokens", "top_k", "seed", "priority", "min_length", "end_id"}


def test_every_integer_input_is_declared_int64_and_so_widened():
    assert set(int64_inputs(CONFIG.read_text())) == INTEGER_INPUTS


@pytest.fixture(scope="module")
def server(tiny_engines):
    """A tritonserver of a tiny engine (max_model_len 256), started as ``kvflow serve`` does."""
    pytest.importorskip("tritonclient.grpc")
    from kvflow.triton_backend.launcher import ServerConfig, TritonServer

    cfg = ServerConfig.on_free_ports(tiny_engines["llama-gqa4", "onnxruntime"], {},
                                     ready_timeout_s=300)
    with TritonServer(cfg) as srv:
        yield srv


def stream(server, arrays: dict[str, np.ndarray]) -> tuple[str, int]:
    """One request over its own gRPC stream: (the text, the output token count). Raises
    RuntimeError with the server's error."""
    import tritonclient.grpc as grpcclient

    responses: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    text, count = "", 0
    try:
        # infer_inputs types each tensor from its array, as TensorRT-LLM's prepare_tensor does.
        client.async_stream_infer("kvflow", infer_inputs(arrays),
                                  enable_empty_final_response=True)
        while True:
            result, error = responses.get(timeout=DEADLINE_S)
            if error is not None:
                raise RuntimeError(str(error))
            if result.as_numpy("text_output") is not None:
                text += result.as_numpy("text_output")[0].decode()
                count = int(result.as_numpy("num_output_tokens")[0])
            if result.get_response().parameters["triton_final_response"].bool_param:
                return text, count
    finally:
        client.stop_stream()
        client.close()


def trtllm_request(dtype: type, max_tokens: int = 6, **integers: int) -> dict[str, np.ndarray]:
    """A greedy streamed request with its integer inputs of ``dtype``. The tiny model's weights
    are random, so its greedy tokens may all be special ones, whose text is empty: a regex
    holds it to letters, so that there is text to compare."""
    return {"text_input": np.array([b"The sky is"], dtype=np.object_),
            "max_tokens": np.array([max_tokens], dtype=dtype),
            "temperature": np.array([0.0], dtype=np.float32),
            "stream": np.array([True]),
            "sampling_parameters": np.array([b'{"guided_regex": "( [a-z]+){6}"}'],
                                            dtype=np.object_),
            **{name: np.array([v], dtype=dtype) for name, v in integers.items()}}


@pytest.mark.slow
def test_an_int32_grpc_client_gets_the_same_text_as_an_int64_one(server):
    # What TensorRT-LLM's end_to_end_grpc_client sends: np.int32 max_tokens, end_id, top_k.
    integers = {"end_id": 2, "top_k": 5, "min_length": 6, "seed": 3}
    text32, count32 = stream(server, trtllm_request(np.int32, **integers))
    text64, count64 = stream(server, trtllm_request(np.int64, **integers))
    assert count32 == count64 == 6  # min_length 6: no early EOS
    assert text32 == text64 and text32


@pytest.mark.slow
def test_the_existing_kvflow_client_still_works(server):
    from kvflow.client import stream_generate

    chunks = list(stream_generate(server.grpc_url, "Hi", {"max_tokens": 3, "ignore_eos": True}))
    assert chunks[-1].num_output_tokens == 3 and chunks[-1].finish_reason == "length"


@pytest.mark.slow
@pytest.mark.parametrize(("arrays", "needle"), [
    # widened with their sign: the backend still checks the range and names the limit
    ({"max_tokens": -1}, "max_tokens must be in [1, 255] (max_model_len 256 minus at least one "
                         "prompt token), got -1"),
    ({"max_tokens": -(2**31)}, "got -2147483648"),
    ({"max_tokens": 2**31 - 1}, "got 2147483647"),
    ({"max_tokens": 3, "min_length": 5}, "min_tokens must be <= max_tokens (3), got 5"),
    ({"max_tokens": 3, "priority": 2**31 - 1}, "priority must be in [-1073741824, 1073741824]"),
])
def test_int32_values_out_of_range_are_refused_naming_the_field_and_the_limit(server, arrays,
                                                                              needle):
    request = {"text_input": np.array([b"Hi"], dtype=np.object_),
               **{name: np.array([v], dtype=np.int32) for name, v in arrays.items()}}
    with pytest.raises(RuntimeError) as e:
        stream(server, request)
    assert needle in str(e.value)


@pytest.mark.slow
def test_only_int32_is_widened_and_only_for_integer_inputs(server):
    text = np.array([b"Hi"], dtype=np.object_)
    for bad in ({"max_tokens": np.array([3], dtype=np.int16)},   # not INT32
                {"max_tokens": np.array([3], dtype=np.uint32)},
                {"temperature": np.array([0], dtype=np.int32)}):  # an FP32 input
        with pytest.raises(RuntimeError, match="data-type is '(INT16|UINT32|INT32)', but model "
                                               "'kvflow' expects '(INT64|FP32)'"):
            stream(server, {"text_input": text, **bad})
    with pytest.raises(RuntimeError, match="unexpected shape for input 'max_tokens'"):
        stream(server, {"text_input": text, "max_tokens": np.array([3, 4], dtype=np.int32)})
    # token ids as INT32 (what TensorRT-LLM's own models take) are widened too
    _, count = stream(server, {"input_ids": np.array([72, 105], dtype=np.int32),
                               "max_tokens": np.array([2], dtype=np.int32)})
    assert count == 2


@pytest.mark.slow
def test_concurrent_int32_and_int64_requests_each_get_their_own_values(server):
    # The widened buffers are per request: 12 requests at once, each its own max_tokens.
    results: dict[int, int] = {}

    def one(i: int) -> None:
        request = trtllm_request(np.int32 if i % 2 else np.int64, max_tokens=i + 1,
                                 min_length=i + 1)
        results[i] = stream(server, request)[1]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(DEADLINE_S)
    assert results == {i: i + 1 for i in range(12)}


@pytest.mark.slow
@pytest.mark.parametrize(("body", "needle"), [
    (b'{"text_input": "Hi", "max_tokens": 4294967301}', "got 4294967301"),  # 2**32 + 5, not 5
    (b'{"text_input": "Hi", "max_tokens": 2147483648}', "got 2147483648"),
    (b'{"text_input": "Hi", "max_tokens": 2, "min_length": 4294967297}', "got 4294967297"),
    (b'{"text_input": "Hi", "max_tokens": 2, "top_k": 4294967295}', "got 4294967295"),  # not -1
])
def test_a_huge_value_over_http_is_refused_never_wrapped(server, body, needle):
    status, reply = post(server, body)
    assert status == 400 and needle in reply["error"], reply


@pytest.mark.slow
def test_non_integers_over_http_are_refused_by_triton(server):
    for raw in (b"1e20", b"1.5", b"18446744073709551621"):
        status, reply = post(server, b'{"text_input": "Hi", "max_tokens": ' + raw + b"}")
        assert status == 500 and "non-signed-integer as signed-integer" in reply["error"]
    # The infer endpoint, where the client names the datatype, is closed to a decoupled model.
    status, reply = post(server, {"inputs": [
        {"name": "text_input", "shape": [1], "datatype": "BYTES", "data": ["Hi"]},
        {"name": "max_tokens", "shape": [1], "datatype": "INT32", "data": [2**32 + 5]}]},
        path="infer")
    assert status == 501 and "decoupled" in reply["error"]
