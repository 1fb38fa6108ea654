"""A self-made demo dataset and tokenizer, so the embedded default run downloads nothing.

Config paths use the ``demo://`` scheme and :func:`resolve_demo_path` turns them into local files,
generating them on first use into a cache directory (``$PIPELINES_CACHE/demo-v1`` or
``~/.cache/pipelines/demo-v1``)::

    resolve_demo_path("demo://tokenizer")  # -> ~/.cache/pipelines/demo-v1/tokenizer   (a HF tokenizer dir)
    resolve_demo_path("demo://sft")        # -> ~/.cache/pipelines/demo-v1/sft.jsonl   (alpaca records)
    resolve_demo_path("demo://text")       # -> ~/.cache/pipelines/demo-v1/text.jsonl  ({"text": ...} docs)
    resolve_demo_path("data/x.jsonl")      # -> "data/x.jsonl" (anything else is returned unchanged)

Everything is deterministic (fixed seeds, no clock, no network), so every node of a cluster that
materializes the files gets byte-identical copies.

The tokenizer is byte-level with no merges: one token per byte, so for ASCII text it is exactly a
character-level tokenizer (``"cat" -> ["c", "a", "t"]``), decoding is lossless for any text, and
``return_offsets_mapping`` gives character offsets. 256 byte tokens + 4 special tokens = 260 ids,
which keeps the demo model's embedding tiny.

The SFT data mixes two tasks a tiny model visibly learns in a few minutes on 2 CPU cores: capitals of
16 countries and opposites of 16 words. In the default run (300 steps) the training loss falls from
~ln(260) = 5.6 to ~0.01 and every one of the 32 answers comes out right under greedy decoding
(BENCHMARKS.md, "Embedded default"). Each record is one short answer under the long Alpaca prompt, so
a step of 16 rows of 256 tokens holds ~16 answers: the tables are kept small enough to be seen ~150
times each in that budget. (Until demo-v4 the tables held 24 entries each plus an uppercasing task; the
model then got 16 of 48 answers right after 300 steps.)
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

DEMO_SCHEME = "demo://"
DEMO_VERSION = "demo-v4"  # bump when the generated content changes, so caches regenerate

PAD, BOS, EOS, IM_START = "<|pad|>", "<|endoftext|>", "<|im_end|>", "<|im_start|>"
SPECIAL_TOKENS = [PAD, BOS, IM_START, EOS]

# ChatML, the format Qwen2 and many others use; `add_generation_prompt` opens an assistant turn.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

SFT_RECORDS = 4000
TEXT_DOCS = 2000


def cache_dir() -> Path:
    """Where demo files live: ``$PIPELINES_CACHE/demo-v1``, else ``~/.cache/pipelines/demo-v1``."""
    root = os.environ.get("PIPELINES_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "pipelines")
    return Path(root) / DEMO_VERSION


def resolve_demo_path(path: str) -> str:
    """Return a local path for ``demo://tokenizer|sft|text`` (creating it once); other paths unchanged."""
    if not isinstance(path, str) or not path.startswith(DEMO_SCHEME):
        return path
    name = path[len(DEMO_SCHEME):].strip("/")
    makers: dict[str, tuple[str, Callable[[Path], None]]] = {
        "tokenizer": ("tokenizer", _write_tokenizer),
        "sft": ("sft.jsonl", _write_sft),
        "text": ("text.jsonl", _write_text),
    }
    if name not in makers:
        raise ValueError(f"unknown demo path {path!r}; known: {', '.join(DEMO_SCHEME + k for k in makers)}")
    filename, make = makers[name]
    target = cache_dir() / filename
    if not target.exists():
        _materialize(target, make)
    return str(target)


def _materialize(target: Path, make: Callable[[Path], None]) -> None:
    """Build ``target`` in a temporary sibling and rename it into place.

    Several processes (tokenizer actors, train workers) may ask at once; each builds its own copy and
    the first rename wins, so nobody ever sees a half-written file.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        built = tmp / target.name
        make(built)
        try:
            os.rename(built, target)
        except OSError:
            if not target.exists():  # a real failure, not a lost race
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# --------------------------------------------------------------------------- tokenizer


def build_demo_tokenizer():  # -> transformers.PreTrainedTokenizerFast
    """The byte-level, merge-free tokenizer described in the module docstring (in memory)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())  # the 256 printable stand-ins for bytes
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + alphabet)}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    # use_regex=False: no word splitting, so offsets map 1:1 onto characters of the input.
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(SPECIAL_TOKENS)
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=[IM_START],
        chat_template=CHAT_TEMPLATE,
        model_max_length=1 << 20,
        clean_up_tokenization_spaces=False,
    )


def _write_tokenizer(out: Path) -> None:
    build_demo_tokenizer().save_pretrained(str(out))


# --------------------------------------------------------------------------- data

_CAPITALS = {
    "France": "Paris", "Japan": "Tokyo", "Italy": "Rome", "Spain": "Madrid", "Egypt": "Cairo",
    "Peru": "Lima", "Kenya": "Nairobi", "Canada": "Ottawa", "Norway": "Oslo", "Chile": "Santiago",
    "Greece": "Athens", "Cuba": "Havana", "Poland": "Warsaw", "Ireland": "Dublin", "Austria": "Vienna",
    "Portugal": "Lisbon",
}
_OPPOSITES = {
    "hot": "cold", "big": "small", "fast": "slow", "up": "down", "day": "night", "happy": "sad",
    "open": "closed", "light": "dark", "early": "late", "full": "empty", "old": "new", "hard": "soft",
    "high": "low", "wet": "dry", "loud": "quiet", "rich": "poor",
}
def _capital(rng: random.Random) -> dict[str, str]:
    country = rng.choice(sorted(_CAPITALS))
    return {"instruction": "Name the capital of the country.", "input": country, "output": _CAPITALS[country]}


def _opposite(rng: random.Random) -> dict[str, str]:
    word = rng.choice(sorted(_OPPOSITES))
    return {"instruction": "Give the opposite of the word.", "input": word, "output": _OPPOSITES[word]}


_TASKS: list[Callable[[random.Random], dict[str, str]]] = [_capital, _opposite]


def demo_sft_records(n: int = SFT_RECORDS, seed: int = 0) -> list[dict[str, str]]:
    """Alpaca-format records of the two tasks, e.g.
    ``{"instruction": "Name the capital of the country.", "input": "Peru", "output": "Lima"}`` and
    ``{"instruction": "Give the opposite of the word.", "input": "hot", "output": "cold"}``."""
    rng = random.Random(seed)
    return [rng.choice(_TASKS)(rng) for _ in range(n)]


_NAMES = ["ana", "bo", "cy", "dee", "eli", "fay", "gus", "hal"]
_THINGS = ["apple", "stone", "coin", "shell", "card"]


def demo_text_docs(n: int = TEXT_DOCS, seed: int = 1) -> list[dict[str, str]]:
    """Tiny stories with simple arithmetic, e.g. 'bo has 7 coins. bo gives 3 coins to fay. now bo has 4 coins.'"""
    rng = random.Random(seed)
    docs = []
    for _ in range(n):
        sentences = []
        for _ in range(rng.randint(2, 5)):
            a, b = rng.sample(_NAMES, 2)
            thing = rng.choice(_THINGS)
            have = rng.randint(2, 9)
            give = rng.randint(1, have - 1)
            sentences.append(
                f"{a} has {have} {thing}s. {a} gives {give} {thing}s to {b}. now {a} has {have - give} {thing}s."
            )
        docs.append({"text": " ".join(sentences)})
    return docs


def _write_jsonl(out: Path, records: list[dict[str, str]]) -> None:
    with out.open("w", encoding="utf-8") as f:
        for rec in records:
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")


def _write_sft(out: Path) -> None:
    _write_jsonl(out, demo_sft_records())


def _write_text(out: Path) -> None:
    _write_jsonl(out, demo_text_docs())


def demo_generations(model_dir: str, n: int = 6, seed: int = 12345) -> list[tuple[str, str, str]]:
    """Greedy answers of a trained demo model on fresh records: ``[(instruction + input, expected, got)]``.

    Shown at the end of the embedded default run, so the learning is visible beyond the loss curve.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipelines.sources.formats import ALPACA_PROMPT

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    for rec in demo_sft_records(n, seed=seed):
        prompt = ALPACA_PROMPT.format(instruction=rec["instruction"], input=rec["input"])
        ids = tok(prompt, return_tensors="pt", add_special_tokens=False).input_ids
        with torch.no_grad():
            gen = model.generate(ids, max_new_tokens=len(rec["output"]) + 2, do_sample=False,
                                 eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        got = tok.decode(gen[0, ids.shape[1]:], skip_special_tokens=True)
        out.append((f"{rec['instruction']} {rec['input']}", rec["output"], got))
    return out
