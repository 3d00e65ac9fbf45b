"""Prompt text for served benchmarks: real English of an exact token count, so that a tokenizer
sees ordinary merges and the model ordinary attention patterns."""

from __future__ import annotations

from collections.abc import Callable

from kvflow.workloads.specs import RequestSpec

# Plain English prose (written for this file), one paragraph per entry. Real text rather than
# random ids, so a tokenizer sees ordinary merges and the model ordinary attention patterns.
CORPUS: tuple[str, ...] = (
    "The harbor town woke slowly on winter mornings. Fishermen checked their nets by lantern "
    "light while the bakery on the corner filled the street with the smell of fresh bread. "
    "Children walked to school in pairs, counting the boats that had already left the bay.",
    "A good library is less a building than a habit. People return to it because it is quiet, "
    "because the chairs are comfortable, and because someone once recommended a book that "
    "changed the way they thought about their own work and their neighbors.",
    "Engineers who build bridges spend most of their time thinking about things that will "
    "probably never happen: the heaviest truck, the strongest wind, the coldest night of the "
    "century. The bridge looks simple only because all of that thinking is hidden.",
    "In the spring the river rose above its banks and covered the lower fields for almost two "
    "weeks. Farmers moved their animals to higher ground, repaired the fences afterwards, and "
    "noticed that the soil was darker and richer than it had been the year before.",
    "Learning a new language as an adult is humbling. You order coffee with great care, the "
    "waiter answers quickly, and you understand only the word for milk. Yet a few months later "
    "you catch yourself dreaming in sentences you did not know you could build.",
    "The old train station was turned into a market with long wooden tables. On Saturdays it "
    "sells cheese, apples, honey and secondhand books, and on weekday evenings a small "
    "orchestra rehearses there because the high ceiling gives the music a warm echo.",
    "Good software tends to be boring in the best sense. It starts quickly, does what the "
    "documentation says, reports errors in plain words, and keeps working when the network is "
    "slow. Nobody writes articles about it, but everyone depends on it every day.",
    "Astronomers measure distances to nearby stars by watching them shift against the distant "
    "background as the Earth moves around the Sun. The angle is tiny, smaller than the width "
    "of a coin seen from several kilometers away, but careful instruments can detect it.",
    "My grandmother kept a notebook of recipes that she never followed exactly. Every page had "
    "corrections in pencil: less sugar, more lemon, bake ten minutes longer if the oven is old. "
    "The notebook was really a record of forty years of tasting and adjusting.",
    "When the power went out across the city, people came down from their apartments and "
    "talked on the front steps. Someone brought a guitar, a shop owner handed out candles, and "
    "for one evening the street felt more like a village than a part of a capital.",
)


def _corpus_text(seed: int, corpus: str | None) -> str:
    """The corpus with its paragraphs (or, for a given corpus, its words) rotated by ``seed``."""
    if corpus is not None:
        parts = corpus.split()
        if not parts:
            raise ValueError("corpus must contain at least one word")
    else:
        parts = list(CORPUS)
    k = seed % len(parts)
    return " ".join(parts[k:] + parts[:k])


def make_prompt_ids(
    tokenizer_encode: Callable[[str], list[int]],
    num_tokens: int,
    seed: int,
    corpus: str | None = None,
) -> list[int]:
    """Exactly ``num_tokens`` token ids of real English text.

    The text is the built-in corpus (or ``corpus``) rotated by ``seed`` and repeated as often
    as needed; its encoding is cut to ``num_tokens``. The ids count whatever
    ``tokenizer_encode`` returns, special tokens included.
    """
    if num_tokens < 1:
        raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
    base = _corpus_text(seed, corpus)
    text = base
    ids = list(tokenizer_encode(text))
    while len(ids) < num_tokens:
        # Double rather than append one copy: each attempt re-encodes the whole text.
        text = text + " " + text
        grown = list(tokenizer_encode(text))
        if len(grown) <= len(ids):
            raise ValueError("tokenizer_encode returns no more tokens for longer text")
        ids = grown
    return ids[:num_tokens]


def make_prompt_text(
    tokenizer_encode: Callable[[str], list[int]],
    tokenizer_decode: Callable[[list[int]], str],
    num_tokens: int,
    seed: int,
) -> tuple[str, int]:
    """Real English text whose re-encoding has ``num_tokens`` tokens, and its actual count.

    Cutting the ids of ``make_prompt_ids`` and decoding them is not enough: with byte-level BPE
    the decode/encode round trip can merge tokens across the cut (or split a broken multi-byte
    character), so the text may re-encode to a different count. The cut point is moved by the
    difference until the count is exact; when no cut gives it exactly, the text with the closest
    count is returned and the second element says how many tokens it really has.
    """
    # A few spare ids past the target so the cut can move right as well as left.
    stream = make_prompt_ids(tokenizer_encode, num_tokens + 64, seed)
    counts: dict[int, int] = {}

    def count(k: int) -> int:
        if k not in counts:
            counts[k] = len(tokenizer_encode(tokenizer_decode(stream[:k])))
        return counts[k]

    k = num_tokens
    for _ in range(32):
        diff = num_tokens - count(k)
        if diff == 0:
            return tokenizer_decode(stream[:k]), num_tokens
        nxt = min(max(k + diff, 1), len(stream))
        if nxt in counts:
            break  # oscillating between cuts: fall back to a local scan
        k = nxt
    for k2 in range(max(1, k - 8), min(len(stream), k + 8) + 1):
        if count(k2) == num_tokens:
            return tokenizer_decode(stream[:k2]), num_tokens
    best = min(counts, key=lambda c: (abs(counts[c] - num_tokens), c))
    return tokenizer_decode(stream[:best]), counts[best]


def make_prompts(specs: list[RequestSpec], engine_dir: str, seed: int) -> list[str]:
    """Real-text prompts of exactly each request's token count (shared groups share a prefix)."""
    from kvflow.text.tokenizer import EngineTokenizer

    tok = EngineTokenizer(engine_dir)

    def encode(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False)

    prompts = []
    for i, s in enumerate(specs):
        if s.prefix_group is None:
            prompts.append(make_prompt_ids(encode, s.prompt_tokens, seed + i))
        else:
            question = 16
            prefix = make_prompt_ids(encode, s.prompt_tokens - question, 10_000 + s.prefix_group)
            prompts.append(prefix + make_prompt_ids(encode, question, seed + i))
    return [tok.decode(p, skip_special_tokens=False) for p in prompts]
