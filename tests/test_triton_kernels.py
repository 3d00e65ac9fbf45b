"""The OpenAI Triton PagedAttention kernels against the PyTorch reference.

On a GPU they run compiled; without one they run in Triton's interpreter (numerically the same
program, on NumPy), which is how CI checks them. Speed is measured in benchmarks/gpu_check.py.
"""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")

if not torch.cuda.is_available():
    # NOTE: must be set before triton is imported: it picks the interpreter at jit time.
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="OpenAI Triton is not installed")

from kvflow.plugins.paged_attention_ref import paged_attention_ref, random_step  # noqa: E402
from kvflow.plugins.paged_attention_triton import paged_attention_triton  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def make_step(seqs: list[tuple[int, int]], heads: int, kv_heads: int, head_dim: int,
              block_size: int, dtype: torch.dtype, seed: int = 0):
    """A packed step of sequences given as (cached tokens, new tokens), with a pool whose
    cached positions hold random K/V and block tables scattered over the pool."""
    return random_step(seqs, heads, kv_heads, head_dim, block_size, dtype,
                       torch.Generator().manual_seed(seed))


def run_both(step, **options):
    ref_in = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in step.items()}
    ref = paged_attention_ref(**ref_in)
    dev_in = {k: (v.to(DEVICE) if torch.is_tensor(v) else v) for k, v in step.items()}
    out = paged_attention_triton(**dev_in, **options)
    return ref, ref_in, out.cpu(), {k: v.cpu() for k, v in dev_in.items() if torch.is_tensor(v)}


MIXED = [(0, 37), (5, 1), (100, 1), (64, 20), (0, 1), (31, 33), (16, 1)]


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "block_size"), [
    (4, 4, 32, 16),   # MHA
    (9, 3, 64, 16),   # SmolLM2's GQA group of 3 (padded to 4 rows per token)
    (8, 2, 32, 4),    # small blocks: several per key tile
])
def test_prefill_chunks_and_decodes_in_one_launch_match_the_reference(heads, kv_heads,
                                                                      head_dim, block_size):
    step = make_step(MIXED, heads, kv_heads, head_dim, block_size, torch.float32)
    ref, ref_in, out, dev = run_both(step)
    assert not torch.isnan(out).any(), "every output element is written"
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    # The new K/V landed where the reference put them, and nowhere else changed.
    torch.testing.assert_close(dev["k_cache"], ref_in["k_cache"], rtol=0, atol=0)
    torch.testing.assert_close(dev["v_cache"], ref_in["v_cache"], rtol=0, atol=0)


def test_padding_slots_are_not_written_and_fp16_stays_within_its_precision():
    step = make_step([(10, 3), (0, 1), (40, 1)], 8, 2, 64, 16, torch.float16, seed=3)
    step["slot_mapping"][1] = -1  # a padded token: its K/V must not be written
    ref, ref_in, out, dev = run_both(step)
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(dev["k_cache"], ref_in["k_cache"], rtol=0, atol=0)


def test_decode_only_batch_of_long_contexts():
    step = make_step([(300, 1), (17, 1), (511, 1), (128, 1)], 8, 2, 32, 16, torch.float32,
                     seed=7)
    ref, _, out, _ = run_both(step)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("num_splits", [2, 4, 16])
def test_split_kv_merges_to_the_reference(num_splits):
    """Split KV (flash decoding): keys cut into ranges, partial results merged. Contexts
    shorter than the splits leave some ranges empty; a sequence with no context at all
    (``seq_len`` 1, its own key only) and prefill tiles go through the same path."""
    step = make_step([(300, 1), (0, 1), (511, 1), (40, 1), (70, 9)], 8, 2, 32, 16,
                     torch.float32, seed=11)
    ref, _, out, _ = run_both(step, num_splits=num_splits)
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


def test_split_kv_counts_are_powers_of_two_and_only_for_gpu_decodes():
    from kvflow.plugins.paged_attention_triton import decode_splits

    step = make_step([(30, 1)], 4, 4, 32, 16, torch.float32)
    with pytest.raises(ValueError, match="num_splits must be a power of two, got 3"):
        paged_attention_triton(**step, num_splits=3)
    assert decode_splits(1, torch.device("cpu")) == 1
    if torch.cuda.is_available():
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        assert decode_splits(1, torch.device("cuda")) == 16
        assert decode_splits(2 * sms, torch.device("cuda")) == 1


def test_head_dim_below_the_dot_minimum_is_padded_and_masked():
    """tl.dot needs an inner dimension of 16 on GPUs: a head dim of 8 (the tiny test models')
    runs in 16-wide tiles whose upper half is masked off."""
    step = make_step([(20, 1), (0, 5), (9, 3)], 4, 2, 8, 4, torch.float32, seed=5)
    ref, ref_in, out, dev = run_both(step)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(dev["k_cache"], ref_in["k_cache"], rtol=0, atol=0)


def test_bad_tile_or_strides_are_refused_by_name():
    step = make_step([(10, 2)], 4, 2, 32, 16, torch.float32)
    with pytest.raises(ValueError, match="block_n must be a power of two >= 16, got 8"):
        paged_attention_triton(**step, block_n=8)
    out = torch.empty(32, 4, 3)[:, :, :1].expand(32, 4, 32)[:2]  # last stride 0
    with pytest.raises(ValueError, match="out must be contiguous in its last dimension"):
        paged_attention_triton(**step, out=out)


def test_group_that_does_not_divide_the_heads_is_refused():
    step = make_step([(0, 2)], 6, 4, 32, 16, torch.float32)
    with pytest.raises(ValueError, match="num_heads=6"):
        paged_attention_triton(**step)


def test_triton_runner_matches_the_torch_runner_step_by_step(tiny_engines):
    """The whole step model with the Triton kernels on a device pool (the interpreter on the
    host without CUDA) gives the torch runner's logits over prefill, decode and mixed steps."""
    import numpy as np

    from kvflow import LLM, SamplingParams

    engine = tiny_engines["llama-gqa4", "torch"]
    prompts = [[5, 9, 13, 2, 7, 31, 8], [4, 4, 6], list(range(3, 40))]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=3)
    outs = {}
    for runner in ("torch", "triton"):
        llm = LLM(engine, runner=runner, max_num_seqs=2, max_num_batched_tokens=16)
        try:
            outs[runner] = llm.generate(prompts, params)
        finally:
            llm.engine.runner.close()
    for ref, got in zip(outs["torch"], outs["triton"], strict=True):
        assert got.token_ids == ref.token_ids
        for a, b in zip(ref.logprobs, got.logprobs, strict=True):
            assert a.keys() == b.keys()
            np.testing.assert_allclose(list(a.values()), list(b.values()), atol=1e-4)


def test_decode_batch_size_buckets():
    from kvflow.runtime.cuda_graphs import decode_batch_sizes

    assert decode_batch_sizes(1) == [1]
    assert decode_batch_sizes(6) == [1, 2, 4, 6]
    assert decode_batch_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert decode_batch_sizes(20) == [1, 2, 4, 8, 16, 20]


def test_decode_graph_buffers_pad_decodes_and_leave_other_steps_eager(tiny_engines):
    """The decode-graph path (static buffers, steps padded to a bucket with sequences that
    read and write nothing) gives the eager runner's tokens and logprobs. On a GPU the graphs
    are captured and replayed; without CUDA the same buffers run uncaptured in the
    interpreter, which checks everything but the capture."""
    import numpy as np

    from kvflow import LLM, SamplingParams

    engine = tiny_engines["llama-gqa4", "torch"]
    # 3 and then 2 running sequences: decode buckets 4 and 2 with padding rows; a prompt
    # longer than the token budget makes mixed prefill/decode steps that must stay eager.
    prompts = [[5, 9, 13, 2, 7, 31, 8], [4, 4, 6], list(range(3, 40)), [7, 7]]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=3)
              for n in (9, 4, 7, 5)]
    outs, decode_steps = {}, {}
    for graphs in (False, True):
        llm = LLM(engine, runner="triton", cuda_graphs=graphs, max_num_seqs=3,
                  max_num_batched_tokens=16)
        runner = llm.engine.runner
        if graphs:
            assert runner.graphs is not None
            assert runner.graphs.captured == torch.cuda.is_available()
            run = runner.graphs.run
            used = []

            def counted(step, b, run=run, used=used):
                used.append((step.num_seqs, b))
                return run(step, b)

            runner.graphs.run = counted
        try:
            outs[graphs] = llm.generate(prompts, params)
        finally:
            runner.close()
        if graphs:
            decode_steps = dict(used)
    assert decode_steps.get(3) == 4 and decode_steps.get(1) == 1  # padded 3 -> 4
    for ref, got in zip(outs[False], outs[True], strict=True):
        assert got.token_ids == ref.token_ids
        for a, b in zip(ref.logprobs, got.logprobs, strict=True):
            assert a.keys() == b.keys()
            np.testing.assert_allclose(list(a.values()), list(b.values()), atol=1e-4)


def test_an_fp16_pool_under_fp32_activations_matches_the_reference_on_the_same_pool():
    """kv_cache_dtype=fp16 on an fp32 engine: the kernels write K/V rounded to the pool's type
    (the reference's bits) and multiply in it, summing in fp32."""
    step = make_step(MIXED, 9, 3, 64, 16, torch.float32, seed=2)
    step["k_cache"], step["v_cache"] = step["k_cache"].half(), step["v_cache"].half()
    ref, ref_in, out, dev = run_both(step)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=2e-3, atol=2e-3)  # queries rounded to fp16
    torch.testing.assert_close(dev["k_cache"], ref_in["k_cache"], rtol=0, atol=0)
    torch.testing.assert_close(dev["v_cache"], ref_in["v_cache"], rtol=0, atol=0)


@pytest.mark.slow  # the whole model in Triton's interpreter without CUDA: tens of seconds
def test_triton_runner_with_an_fp16_pool_gives_the_torch_runners_fp16_tokens(tiny_engines):
    import numpy as np

    from kvflow import LLM, SamplingParams

    engine = tiny_engines["llama-gqa4", "torch"]
    prompts = [[5, 9, 13, 2, 7, 31, 8], list(range(3, 30))]
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=2)
    outs = {}
    for runner in ("torch", "triton"):
        with LLM(engine, runner=runner, kv_cache_dtype="fp16", max_num_seqs=2,
                 max_num_batched_tokens=16) as llm:
            assert llm.engine.runner.kv_cache_dtype == "fp16"
            assert llm.engine.runner.pool.k[0].dtype in (np.float16, torch.float16)
            outs[runner] = llm.generate(prompts, params)
    for ref, got in zip(outs["torch"], outs["triton"], strict=True):
        assert got.token_ids == ref.token_ids
        for a, b in zip(ref.logprobs, got.logprobs, strict=True):
            np.testing.assert_allclose(list(a.values()), list(b.values()), atol=2e-3)
