"""LoRA through the whole engine against HF + PEFT, on a tiny model: adapters made with peft
(random nonzero A and B), kvflow's greedy output on the fp32 path equal to PEFT's greedy
generate, for the PyTorch runner and the ONNX Runtime runner's LoraMatMul op; a batch mixing
adapters and the base; the prefix cache keyed by adapter; more adapters than slots; the
LLM's load / unload lifecycle."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

from kvflow import LLM, SamplingParams  # noqa: E402
from kvflow.lora.synthetic import make_peft_adapter  # noqa: E402
from tests.helpers import assert_same_or_near_tie  # noqa: E402

MODEL = "llama-gqa4"
NEW_TOKENS = 10
PROMPTS = [[1, 40, 41, 42, 43, 44, 45, 46, 47, 48], [1, 60, 70, 80, 90, 100, 110],
           [1, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16]]
RUNNERS = ("torch", "onnxruntime")


@pytest.fixture(scope="module")
def adapters(tiny_models, tmp_path_factory) -> dict[str, Path]:
    hf_dir = tiny_models[MODEL][0]
    root = tmp_path_factory.mktemp("peft")
    return {f"ad{i}": make_peft_adapter(hf_dir, root / f"ad{i}", rank=4 + 2 * (i % 2),
                                        alpha=8, seed=i, scale=0.2,
                                        use_rslora=i == 3) for i in range(4)}


@pytest.fixture(scope="module")
def reference(tiny_models, adapters):
    """(adapter or None, prompt index) -> (HF + PEFT greedy tokens, their logits rows)."""
    import transformers
    from peft import PeftModel

    hf_dir = tiny_models[MODEL][0]
    cache: dict[tuple[str | None, int], tuple[list[int], list[np.ndarray]]] = {}

    def get(name: str | None, i: int) -> tuple[list[int], list[np.ndarray]]:
        if (name, i) not in cache:
            model = transformers.AutoModelForCausalLM.from_pretrained(
                str(hf_dir), dtype=torch.float32).eval()
            if name is not None:
                model = PeftModel.from_pretrained(model, str(adapters[name])).eval()
            ids = torch.tensor([PROMPTS[i]])
            with torch.no_grad():
                out = model.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                     do_sample=False, return_dict_in_generate=True,
                                     output_scores=True, pad_token_id=0)
            tokens = out.sequences[0, len(PROMPTS[i]):].tolist()
            cache[name, i] = tokens, [s[0].numpy() for s in out.scores]
        return cache[name, i]

    return get


def make_llm(tiny_engines, runner: str, **overrides) -> LLM:
    return LLM(tiny_engines[MODEL, runner], runner=runner, kv_cache_dtype="fp32",
               quantized_matmul="fp32", debug_checks=True, **overrides)


GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


def check(outputs, loras, prompts, reference) -> None:
    for out, lora, i in zip(outputs, loras, prompts, strict=True):
        tokens, logits = reference(lora, i)
        assert_same_or_near_tie(out.outputs[0].token_ids, tokens, logits)


@pytest.mark.parametrize("runner", RUNNERS)
def test_greedy_equals_hf_peft_in_a_batch_mixing_adapters_and_the_base(
        tiny_engines, adapters, reference, runner):
    loras = ["ad0", "ad1", None, "ad1", "ad0", None]
    prompts = [0, 1, 2, 0, 2, 1]
    with make_llm(tiny_engines, runner, lora_modules={n: str(adapters[n])
                                                      for n in ("ad0", "ad1")}) as llm:
        batch = llm.generate([PROMPTS[i] for i in prompts], GREEDY, lora=loras)
        check(batch, loras, prompts, reference)
        alone = [llm.generate([PROMPTS[i]], GREEDY, lora=lora)[0]
                 for lora, i in zip(loras, prompts, strict=True)]
    assert [o.outputs[0].token_ids for o in batch] == [o.outputs[0].token_ids for o in alone]
    # The adapters change the output (else the test would prove nothing).
    assert len({tuple(reference(lora, 0)[0]) for lora in (None, "ad0", "ad1")}) == 3


@pytest.mark.parametrize("runner", RUNNERS)
def test_two_adapters_on_one_prompt_share_no_block_and_both_are_exact(
        tiny_engines, adapters, reference, runner):
    with make_llm(tiny_engines, runner, enable_lora=True, enable_prefix_caching=True) as llm:
        llm.load_lora("x", adapters["ad0"])
        llm.load_lora("y", adapters["ad2"])
        sched = llm.engine.scheduler
        hits = []
        for lora, name in (("x", "ad0"), ("y", "ad2"), (None, None), ("x", "ad0")):
            before = sched.prefix_cache_hits
            out = llm.generate([PROMPTS[2]], GREEDY, lora=lora)
            hits.append(sched.prefix_cache_hits - before)
            check(out, [name], [2], reference)
    assert hits[:3] == [0, 0, 0] and hits[3] > 0  # the same adapter again: a hit


@pytest.mark.parametrize("runner", RUNNERS)
def test_more_adapters_than_slots_under_load_are_all_exact(tiny_engines, adapters, reference,
                                                         runner):
    names = list(adapters)
    loras = [names[k % 4] for k in range(8)] + [None]
    prompts = [k % 3 for k in range(9)]
    with make_llm(tiny_engines, runner, max_loras=2, max_lora_rank=8,
                  lora_modules={n: str(p) for n, p in adapters.items()},
                  max_num_seqs=4) as llm:
        outputs = llm.generate([PROMPTS[i] for i in prompts], GREEDY, lora=loras)
        check(outputs, loras, prompts, reference)
        assert llm.engine.lora.evictions > 0


def test_llm_load_unload_and_load_again(tiny_engines, adapters, reference):
    with make_llm(tiny_engines, "torch", enable_lora=True, max_loras=1) as llm:
        llm.load_lora("mine", adapters["ad1"])
        check(llm.generate([PROMPTS[0]], GREEDY, lora="mine"), ["ad1"], [0], reference)
        llm.unload_lora("mine")
        with pytest.raises(ValueError, match="model: no adapter 'mine'; loaded: \\[\\]"):
            llm.generate([PROMPTS[0]], GREEDY, lora="mine")
        llm.load_lora("mine", adapters["ad3"])  # another adapter under the same name
        check(llm.generate([PROMPTS[0]], GREEDY, lora="mine"), ["ad3"], [0], reference)
        assert [a["name"] for a in llm.list_loras()] == ["mine"]
        with pytest.raises(ValueError, match="got 2 lora names for 1 prompts"):
            llm.generate([PROMPTS[0]], GREEDY, lora=["mine", None])


@pytest.mark.slow
def test_default_model_greedy_equals_hf_peft(default_engines, tmp_path):
    """The default model (its ONNX Runtime engine, fp32 matmuls and KV) with two PEFT adapters
    made on HF's own weights of the same GGUF: a batch mixing them and the base gives each
    request HF + PEFT's greedy tokens."""
    import transformers
    from peft import PeftModel

    from kvflow.bench.lora_adapters import hf_folder

    base = hf_folder("default", tmp_path)
    folders = {n: make_peft_adapter(base, tmp_path / n, rank=8, alpha=16, seed=s, scale=0.05)
               for n, s in (("d1", 1), ("d2", 2))}
    prompts = [[1, 504, 3458, 314, 260, 1345, 30], [1, 2683, 2130, 282, 4077, 314],
               [1, 504, 3458, 314, 260, 1345, 30]]
    loras = ["d1", "d2", None]
    with LLM(default_engines["onnxruntime"], quantized_matmul="fp32", kv_cache_dtype="fp32",
             lora_modules={n: str(p) for n, p in folders.items()}, max_lora_rank=8) as llm:
        outputs = llm.generate(prompts, GREEDY, lora=loras)
    for out, prompt, lora in zip(outputs, prompts, loras, strict=True):
        model = transformers.AutoModelForCausalLM.from_pretrained(str(base),
                                                                  dtype=torch.float32).eval()
        if lora is not None:
            model = PeftModel.from_pretrained(model, str(folders[lora])).eval()
        with torch.no_grad():
            ref = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS,
                                 min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0,
                                 return_dict_in_generate=True, output_scores=True)
        assert_same_or_near_tie(out.outputs[0].token_ids,
                                ref.sequences[0, len(prompt):].tolist(),
                                [s[0].numpy() for s in ref.scores])
    assert outputs[0].outputs[0].token_ids != outputs[2].outputs[0].token_ids  # d1 vs base
