"""Each model family's real chat template (tests/data/templates, sources in its README) in a
small offline tokenizer folder with the family's special tokens: one token per byte, plus the
family's added tokens, so kvflow's EngineTokenizer and transformers' tokenizer read the same
folder. The special tokens' ids are small and arbitrary; their text and their ``special`` flag
are the checkpoint's."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

TEMPLATES = Path(__file__).parent / "data" / "templates"


@dataclass(frozen=True)
class Family:
    """A family's template file, its named special tokens, its added tokens (special and
    not), and the eos ids of its generation_config.json, as token texts."""

    template: str
    bos: str | None
    eos: str
    special: tuple[str, ...]
    plain: tuple[str, ...] = ()  # added tokens that are not special (Qwen's <tool_call>)
    pad: str | None = None
    generation_eos: tuple[str, ...] = ()


_QWEN_PLAIN = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
FAMILIES = {
    "qwen3": Family("Qwen-Qwen3-0.6B.jinja", None, "<|im_end|>",
                    ("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
                    (*_QWEN_PLAIN, "<think>", "</think>"), "<|endoftext|>",
                    ("<|im_end|>", "<|endoftext|>")),
    "qwen2.5": Family("Qwen-Qwen2.5-7B-Instruct.jinja", None, "<|im_end|>",
                      ("<|endoftext|>", "<|im_start|>", "<|im_end|>"), _QWEN_PLAIN,
                      "<|endoftext|>", ("<|im_end|>", "<|endoftext|>")),
    "gemma2": Family("google-gemma-2-2b-it.jinja", "<bos>", "<eos>",
                     ("<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"),
                     pad="<pad>", generation_eos=("<eos>", "<end_of_turn>")),
    "gemma3": Family("google-gemma-3-1b-it.jinja", "<bos>", "<eos>",
                     ("<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"),
                     pad="<pad>", generation_eos=("<eos>", "<end_of_turn>")),
    "llama3.1": Family("meta-llama-Llama-3.1-8B-Instruct.jinja", "<|begin_of_text|>",
                       "<|eot_id|>",
                       ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                        "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>"),
                       generation_eos=("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>")),
    "llama3.2": Family("meta-llama-Llama-3.2-3B-Instruct.jinja", "<|begin_of_text|>",
                       "<|eot_id|>",
                       ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                        "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>"),
                       generation_eos=("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>")),
    "phi3.5": Family("microsoft-Phi-3.5-mini-instruct.jinja", "<s>", "<|endoftext|>",
                     ("<unk>", "<s>", "</s>", "<|endoftext|>", "<|assistant|>", "<|system|>",
                      "<|end|>", "<|user|>"),
                     generation_eos=("<|end|>", "<|assistant|>", "<|endoftext|>")),
    "phi4-mini": Family("microsoft-Phi-4-mini-instruct.jinja", "<|endoftext|>",
                        "<|endoftext|>",
                        ("<|endoftext|>", "<|assistant|>", "<|system|>", "<|end|>", "<|user|>",
                         "<|tool|>", "<|/tool|>", "<|tool_call|>", "<|/tool_call|>",
                         "<|tool_response|>"),
                        generation_eos=("<|end|>", "<|endoftext|>")),
    "mistral-nemo": Family("mistralai-Mistral-Nemo-Instruct-2407.jinja", "<s>", "</s>",
                           ("<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]",
                            "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]",
                            "[TOOL_CALLS]"),
                           generation_eos=("</s>",)),
    "mistral-small-3.2": Family("mistralai-Mistral-Small-3.2-24B-Instruct-2506.jinja", "<s>",
                                "</s>",
                                ("<unk>", "<s>", "</s>", "[INST]", "[/INST]",
                                 "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]",
                                 "[/TOOL_RESULTS]", "[TOOL_CALLS]", "[IMG]", "[SYSTEM_PROMPT]",
                                 "[/SYSTEM_PROMPT]", "[TOOL_CONTENT]", "[ARGS]", "[CALL_ID]"),
                                generation_eos=("</s>",)),
}


def write_folder(folder: Path, family: Family) -> Path:
    """``tokenizer.json``, ``tokenizer_config.json`` (with the template) and
    ``generation_config.json`` of ``family`` in ``folder``."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    specials = [*family.special, *family.plain]
    vocab = {t: i for i, t in enumerate(specials)}
    for c in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[c] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t in family.special])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in family.plain])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": family.eos,
              "chat_template": (TEMPLATES / family.template).read_text(),
              "model_max_length": 32768}
    if family.bos is not None:
        config["bos_token"] = family.bos
    if family.pad is not None:
        config["pad_token"] = family.pad
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [vocab[t] for t in family.generation_eos]}))
    return folder
