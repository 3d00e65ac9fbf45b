"""Multi-LoRA in the runners, on tiny models: an adapter in a slot gives the logits of the
model with that adapter merged into its weights (``W + B A``), on the ONNX Runtime runner
(``kvflow::LoraMatMul`` in its fused graph) and the PyTorch runner (hooks); a step mixing two
adapters and the base gives each sequence what it gets alone; and LoRA off changes nothing."""

from __future__ import annotations

import copy
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    # NOTE: set before triton is imported: it picks the interpreter at jit time.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kvflow.build.engine_config import EngineConfig  # noqa: E402
from kvflow.model.lora_hooks import lora_linears  # noqa: E402
from kvflow.plugins import ort_custom_ops  # noqa: E402
from kvflow.runtime import lora_pool  # noqa: E402
from kvflow.runtime.ort_runner import OnnxRuntimeRunner  # noqa: E402
from kvflow.runtime.torch_runner import TorchRunner, load_model  # noqa: E402
from tests.test_lora_kernels import Adapter  # noqa: E402
from tests.test_ort_runner import step  # noqa: E402

TOL = 1e-4
needs_native = pytest.mark.skipif(
    ort_custom_ops.library() is None,
    reason=f"the native op is unavailable: {ort_custom_ops.unavailable_reason()}")

Seq = tuple[list[int], int, int, list[int]]  # tokens, start, new tokens, blocks


def random_adapter(model, name: str, ranks: dict[str, int], seed: int,
                   scale: float = 0.1) -> Adapter:
    """Random nonzero A and B (normal, ``scale``; B as the loader leaves it, scaling folded in)
    for the modules of ``ranks`` in every layer."""
    rng = np.random.default_rng(seed)
    weights = {}
    for (layer, module), linear in lora_linears(model).items():
        r = ranks.get(module, 0)
        if r:
            out_f, in_f = linear.weight.shape
            weights[layer, module] = (rng.normal(0, scale, (r, in_f)).astype(np.float32),
                                      rng.normal(0, scale, (out_f, r)).astype(np.float32))
    return Adapter(name, max(ranks.values()), weights)


def merged(model, adapter: Adapter):
    """A copy of ``model`` with ``W + B A`` in every linear the adapter targets."""
    out = copy.deepcopy(model)
    linears = lora_linears(out)
    with torch.no_grad():
        for key, (a, b) in adapter.weights.items():
            linears[key].weight += torch.from_numpy(b) @ torch.from_numpy(a)
    return out


def with_slots(seqs: list[Seq], slots: list[int], block_size: int, padding: int = 0):
    s = step(seqs, block_size, padding)
    per_token = [slot for (_, _, n, _), slot in zip(seqs, slots, strict=True) for _ in range(n)]
    s.lora_slots = np.array(per_token + [-1] * padding, np.int32)
    return s


def make_runners(tiny_engines, name: str, max_loras: int):
    ort_dir, torch_dir = tiny_engines[name, "onnxruntime"], tiny_engines[name, "torch"]
    ort_runner = OnnxRuntimeRunner(ort_dir, EngineConfig.load(ort_dir), 64, threads=1,
                                   attention="native", max_loras=max_loras, max_lora_rank=8)
    torch_runner = TorchRunner(torch_dir, EngineConfig.load(torch_dir), 64,
                               max_loras=max_loras, max_lora_rank=8)
    return {"onnxruntime": ort_runner, "torch": torch_runner}


PROMPT_A = list(range(40, 71))
PROMPT_B = list(range(100, 113))
PROMPT_C = list(range(200, 222))
ALL = {"q_proj": 4, "k_proj": 4, "v_proj": 4, "o_proj": 4, "gate_proj": 4, "up_proj": 4,
       "down_proj": 4}
SOME = {"q_proj": 8, "v_proj": 2, "down_proj": 3}  # ranks differ by module; k, o, gate, up off


@needs_native
@pytest.mark.parametrize("model_name", ["llama-gqa4", "qwen2-bias"])
def test_adapter_in_a_slot_equals_the_merged_model(tiny_engines, model_name):
    """Slot 1 holds the adapter: a chunked prefill and decodes give the merged model's logits
    on both runners (the last layer runs on the sampled rows only in the ORT graph)."""
    torch_dir = tiny_engines[model_name, "torch"]
    engine = EngineConfig.load(torch_dir)
    base = load_model(torch_dir, engine)
    adapter = random_adapter(base, "all", ALL, seed=1)
    reference = TorchRunner(torch_dir, engine, 64, model=merged(base, adapter))
    plain = TorchRunner(torch_dir, engine, 64, model=base)
    runners = make_runners(tiny_engines, model_name, max_loras=2)
    try:
        for r in runners.values():
            r.load_lora(1, adapter)
        blocks = [5, 9, 2, 14, 7, 30, 31, 40, 41, 42]
        steps = [[(PROMPT_A, 0, 17, blocks)], [(PROMPT_A, 17, 14, blocks)],
                 [(PROMPT_A, 31, 1, blocks)]]
        seq = PROMPT_A + [77]
        for seqs in steps:
            seqs = [(seq, *rest) for _, *rest in seqs]
            want = reference.execute(step(seqs, 4))
            assert not np.allclose(want, plain.execute(step(seqs, 4)), atol=1e-3), \
                "the adapter changes the logits (else this test proves nothing)"
            for name, r in runners.items():
                got = r.execute(with_slots(seqs, [1], 4))
                np.testing.assert_allclose(got, want, atol=TOL, rtol=0, err_msg=name)
    finally:
        for r in (*runners.values(), reference, plain):
            r.close()


@needs_native
def test_a_mixed_step_gives_each_sequence_what_it_gets_alone(tiny_engines):
    """Sequences of slot 0, slot 1 and the base, and a padding row, in one step (then a decode
    step of all three): each row equals the sequence's own step. An adapter may leave modules
    out and use different ranks per module."""
    runners = make_runners(tiny_engines, "llama-gqa4", max_loras=3)
    base = runners["torch"].model
    adapters = [random_adapter(base, "all", ALL, seed=2), random_adapter(base, "some", SOME, 3)]
    try:
        for r in runners.values():
            for slot, adapter in enumerate(adapters):
                r.load_lora(slot, adapter)
        a, b, c = ((p, [blk + 10 * i for blk in (1, 2, 3, 4, 5, 6, 7, 8)])
                   for i, p in enumerate((PROMPT_A, PROMPT_B, PROMPT_C)))
        for name, r in runners.items():
            prefill = [(a[0], 0, 31, a[1]), (b[0], 0, 13, b[1]), (c[0], 0, 22, c[1])]
            mixed = r.execute(with_slots(prefill, [0, 1, -1], 4, padding=2))[:3]
            alone = [r.execute(with_slots([seq], [slot], 4))[0]
                     for seq, slot in zip(prefill, [0, 1, -1], strict=True)]
            np.testing.assert_allclose(mixed, np.stack(alone), atol=1e-5, rtol=0, err_msg=name)
            decode = [(a[0] + [9], 31, 1, a[1]), (b[0] + [9], 13, 1, b[1]),
                      (c[0] + [9], 22, 1, c[1])]
            mixed = r.execute(with_slots(decode, [0, 1, -1], 4))
            base_rows = r.execute(step(decode, 4))
            np.testing.assert_array_equal(mixed[2], base_rows[2], err_msg=name)
            assert not np.allclose(mixed[1], base_rows[1], atol=1e-3)
    finally:
        for r in runners.values():
            r.close()


@needs_native
def test_lora_off_is_bit_identical_and_the_pool_is_freed(tiny_engines):
    """A runner with a pool but no adapter in the step (lora_slots None, or all -1) gives
    exactly the logits of a runner without LoRA; closing frees the pool's registrations."""
    before = lora_pool.registered_arrays()
    plain = make_runners(tiny_engines, "qwen2-bias", max_loras=0)
    lora = make_runners(tiny_engines, "qwen2-bias", max_loras=2)
    try:
        assert lora_pool.registered_arrays() > before
        assert plain["torch"].lora_pool_bytes == 0 < lora["torch"].lora_pool_bytes
        for r in lora.values():
            r.load_lora(0, random_adapter(plain["torch"].model, "all", ALL, seed=4))
        seqs = [(PROMPT_A, 0, 31, [1, 2, 3, 4, 5, 6, 7, 8]), (PROMPT_B, 0, 13, [9, 10, 11, 12])]
        for name in plain:
            want = plain[name].execute(step(seqs, 4))
            np.testing.assert_array_equal(lora[name].execute(step(seqs, 4)), want)
            np.testing.assert_array_equal(lora[name].execute(with_slots(seqs, [-1, -1], 4)),
                                          want)
        with pytest.raises(ValueError, match="no LoRA pool"):
            plain["onnxruntime"].execute(with_slots(seqs, [0, 0], 4))
        with pytest.raises(ValueError, match="pass max_loras and max_lora_rank to create_runner"):
            plain["onnxruntime"].enable_lora(2, 8)
        ort_dir = tiny_engines["qwen2-bias", "onnxruntime"]
        with pytest.raises(RuntimeError, match="needs its native op library"):
            OnnxRuntimeRunner(ort_dir, EngineConfig.load(ort_dir), 64, attention="segmented",
                              max_loras=2)
    finally:
        for r in (*plain.values(), *lora.values()):
            r.close()
    assert lora_pool.registered_arrays() == before


@pytest.mark.parametrize("cuda_graphs", [False, True])
def test_triton_runner_adapter_equals_the_merged_model(tiny_engines, cuda_graphs):
    """The triton runner (Triton's interpreter without a GPU) with an adapter in slot 0 beside
    a base sequence: the merged model's logits for the one, the base's for the other. With
    ``cuda_graphs`` the decode step runs the LoRA decode graphs' static buffers (eagerly
    without CUDA)."""
    pytest.importorskip("triton", reason="OpenAI Triton is not installed")
    from kvflow.runtime import create_runner

    torch_dir = tiny_engines["llama-gqa4", "torch"]
    engine = EngineConfig.load(torch_dir)
    base = load_model(torch_dir, engine)
    adapter = random_adapter(base, "some", SOME, seed=5)
    reference = TorchRunner(torch_dir, engine, 64, model=merged(base, adapter))
    plain = TorchRunner(torch_dir, engine, 64, model=base)
    runner = create_runner("triton", torch_dir, 64, cuda_graphs=cuda_graphs, max_loras=2,
                           max_lora_rank=8)
    try:
        assert runner.supports_lora and runner.lora_pool_bytes > 0
        runner.load_lora(0, adapter)
        a = (PROMPT_A, 0, 31, [1, 2, 3, 4, 5, 6, 7, 8])
        b = (PROMPT_B, 0, 13, [9, 10, 11, 12])
        got = runner.execute(with_slots([a, b], [0, -1], 4))
        np.testing.assert_allclose(got[0], reference.execute(step([a], 4))[0], atol=TOL)
        np.testing.assert_allclose(got[1], plain.execute(step([b], 4))[0], atol=TOL)
        decode = [(PROMPT_A + [5], 31, 1, a[3]), (PROMPT_B + [5], 13, 1, b[3])]
        got = runner.execute(with_slots(decode, [0, -1], 4))
        np.testing.assert_allclose(got[0], reference.execute(step(decode[:1], 4))[0], atol=TOL)
        np.testing.assert_allclose(got[1], plain.execute(step(decode[1:], 4))[0], atol=TOL)
        assert (runner.lora_graphs is not None) == cuda_graphs  # type: ignore[attr-defined]
    finally:
        for r in (runner, reference, plain):
            r.close()
