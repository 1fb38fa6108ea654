"""The one tokenizer loader, the label value that takes no loss, and the tokenizer's fingerprint.

Everything that needs the configured tokenizer (the tokenizer actors, ``convert.py --tokenize``, the
training workers, the MDS tokenizer check) loads it here, so all of them see the same tokenizer with
the same settings: ``demo://tokenizer`` made local, a pad token (the EOS token where the tokenizer
has none; padding never reaches the loss), never the Hub at run time.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipelines.config import ModelConfig

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["IGNORE_INDEX", "Backend", "load_backend", "load_tokenizer", "loads_without_transformers", "resolve_tokenizer_path",
           "shared_tokenizer", "tokenizer_fingerprint", "tokenizer_sha256"]

# Label of a token that takes no loss (PyTorch's cross-entropy ``ignore_index`` default).
IGNORE_INDEX = -100

logger = logging.getLogger(__name__)


def resolve_tokenizer_path(model: ModelConfig) -> str:
    """``model.tokenizer`` (or ``name_or_path``) with ``demo://`` made local."""
    path = model.tokenizer_path
    if path.startswith("demo://"):
        from pipelines.demo import resolve_demo_path

        path = resolve_demo_path(path)
    return path


def load_tokenizer(model: ModelConfig) -> PreTrainedTokenizerBase:
    """The configured Hugging Face tokenizer (local directory or cached id), with a pad token.

    Where ``tokenizer.json`` alone describes the tokenizer exactly (:func:`loads_without_transformers`), it
    is loaded as it is, as a ``PreTrainedTokenizerFast`` (transformers 5's ``TokenizersBackend``) with the
    special tokens and chat template of ``tokenizer_config.json``. ``AutoTokenizer`` in transformers 5
    instead rebuilds a tokenizer from its declared class, and for some classes that changes the encoding:
    SmolLM2 declares ``GPT2Tokenizer``, whose rebuild drops the file's ``Digits`` pre-tokenizer and its
    added tokens, so ``"\\n\\n1."`` becomes ``[198, 198, 33, 30]`` instead of the ``[1116, 33, 30]`` the model
    was trained on (huggingface/transformers#45701; allenai/open-instruct#1896 saw the same with Dolma 2).
    Loading the file also keeps torch out of the tokenizer processes (``AutoTokenizer`` imports it: ~2 s).
    Everything else (remote code, a Hub id, a config key transformers applies to the Rust tokenizer) goes
    through ``AutoTokenizer``.
    """
    path = resolve_tokenizer_path(model)
    if model.trust_remote_code:
        logger.warning("model.trust_remote_code is on: code shipped with %s will run", model.tokenizer_path)
    if loads_without_transformers(model):
        from transformers import PreTrainedTokenizerFast

        tok = PreTrainedTokenizerFast.from_pretrained(path)
    else:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(path, trust_remote_code=model.trust_remote_code)
    if tok.pad_token_id is None and tok.eos_token is not None:  # e.g. Llama/GPT-2 tokenizers
        tok.pad_token = tok.eos_token
    return tok


def tokenizer_sha256(hf: Any) -> str:
    """sha256 of the tokenizer's ``tokenizer.json`` as the tokenizers library writes it, with truncation
    and padding cleared (the pipeline never uses them), so equal tokenizers hash equal whatever the file's
    formatting: GPT-2's upstream file (truncation 50) and its cleaned copy give the same hash."""
    from tokenizers import Tokenizer as RustTokenizer

    backend = RustTokenizer.from_str(hf.backend_tokenizer.to_str())
    backend.no_truncation()
    backend.no_padding()
    return hashlib.sha256(backend.to_str().encode("utf-8")).hexdigest()


def tokenizer_fingerprint(model: ModelConfig) -> dict[str, str]:
    """``{"name": <as configured>, "sha256": <tokenizer_sha256>}`` of the configured tokenizer."""
    return {"name": model.tokenizer_path, "sha256": tokenizer_sha256(load_tokenizer(model))}


# Keys of tokenizer_config.json that make transformers rewrite the Rust tokenizer it loads (its
# post-processor or pre-tokenizer); with any of them set, only transformers gives the right encoding.
BACKEND_REWRITING_KEYS = ("add_bos_token", "add_eos_token", "add_prefix_space", "legacy", "from_slow")


@dataclass(frozen=True)
class Backend:
    """What the tokenizer stage encodes with: the Rust tokenizer, its EOS id and vocabulary size."""

    tokenizer: Any  # tokenizers.Tokenizer, truncation and padding cleared
    eos_token_id: int | None
    vocab_size: int  # with added tokens (len() of the transformers tokenizer)
    direct: bool  # loaded through ``tokenizers`` alone, without transformers


def _token_content(value: Any) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


def _direct_files(model: ModelConfig) -> tuple[Path, dict[str, Any]] | None:
    """``tokenizer.json`` and the merged token config where ``tokenizers`` alone loads the tokenizer exactly,
    else None (no local tokenizer.json, remote code, or a config key that transformers applies to the Rust
    tokenizer, see :data:`BACKEND_REWRITING_KEYS`). Reads the small JSON configs only."""
    if model.trust_remote_code:
        return None
    root = Path(resolve_tokenizer_path(model))
    if not (root / "tokenizer.json").is_file():
        return None
    config: dict[str, Any] = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):  # the config wins, as in transformers
        if (root / name).is_file():
            config.update(json.loads((root / name).read_text(encoding="utf-8")))
    if any(config.get(k) for k in BACKEND_REWRITING_KEYS):
        return None
    return root / "tokenizer.json", config


def loads_without_transformers(model: ModelConfig) -> bool:
    """Whether :func:`load_backend` (with no transformers tokenizer at hand) loads through ``tokenizers``
    alone, checked from the tokenizer's files without loading it. Its one other fallback, an EOS token
    missing from the vocabulary, is found only by loading."""
    return _direct_files(model) is not None


def _direct_backend(model: ModelConfig) -> Backend | None:
    """The tokenizer through ``tokenizers`` alone (no transformers import: ~0.7 s less per process), or
    None when only transformers loads it exactly (:func:`_direct_files`, or an EOS token it cannot find)."""
    files = _direct_files(model)
    if files is None:
        return None
    path, config = files
    from tokenizers import Tokenizer as RustTokenizer

    tok = RustTokenizer.from_file(str(path))
    tok.no_truncation()
    tok.no_padding()
    eos = _token_content(config.get("eos_token"))
    eos_id = tok.token_to_id(eos) if eos else None
    if eos and eos_id is None:
        return None
    return Backend(tok, eos_id, tok.get_vocab_size(with_added_tokens=True), direct=True)


def load_backend(model: ModelConfig, hf: Any | None = None) -> Backend:
    """The Rust tokenizer for encoding: through ``tokenizers`` directly when that gives exactly what
    transformers would (and ``hf`` is not already loaded), else from the transformers tokenizer.

    Lengths are the pipeline's to manage: a truncation or padding setting saved inside tokenizer.json
    (the upstream GPT-2 file truncates at 50 tokens) would silently cut samples, so both are cleared.
    """
    if hf is None:
        direct = _direct_backend(model)
        if direct is not None:
            return direct
        hf = load_tokenizer(model)
    if not getattr(hf, "is_fast", False):
        raise ValueError(f"tokenizer {model.tokenizer_path!r} is not a fast tokenizer (needs tokenizer.json)")
    tok = hf.backend_tokenizer
    tok.no_truncation()
    tok.no_padding()
    return Backend(tok, hf.eos_token_id, len(hf), direct=False)


# The tokenizers this process's stages share (shared_tokenizer): files key + with_hf -> (transformers
# tokenizer or None, backend).
_SHARED: OrderedDict[tuple[Any, ...], tuple[Any, Backend]] = OrderedDict()
_SHARED_KEEP = 4
_SHARED_LOCK = threading.Lock()


def _files_key(model: ModelConfig) -> tuple[Any, ...]:
    """What the configured tokenizer loads from: a local directory's path and each file's name, size and
    modification time (a file rewritten in place changes the key), else the name as configured (a cached Hub
    id), and whether remote code runs."""
    path = resolve_tokenizer_path(model)
    root = Path(path)
    if not root.is_dir():
        return (path, model.trust_remote_code)
    stats = ((p.name, p.stat()) for p in root.iterdir() if p.is_file())
    files = sorted((name, st.st_size, st.st_mtime_ns) for name, st in stats)
    return (str(root.resolve()), tuple(files), model.trust_remote_code)


def shared_tokenizer(model: ModelConfig, with_hf: bool) -> tuple[PreTrainedTokenizerBase | None, Backend]:
    """``(transformers tokenizer or None, backend)`` for the tokenizer stages, loaded once per process and
    tokenizer files (:func:`load_backend`; the transformers tokenizer too where ``with_hf``).

    A shared read worker builds a stage for every stream it serves, and the feeder opens a stream per source
    and per epoch: each would load the same tokenizer again (longer for larger vocabularies, and again
    through transformers). The stages only encode and apply chat
    templates, so they can share one; callers must not change what this returns (:func:`load_backend` has
    cleared truncation and padding, once). Anything else loads its own (:func:`load_tokenizer`).
    """
    key = (_files_key(model), with_hf)
    with _SHARED_LOCK:
        if key in _SHARED:
            _SHARED.move_to_end(key)
            return _SHARED[key]
    hf = load_tokenizer(model) if with_hf else None
    loaded = (hf, load_backend(model, hf))
    with _SHARED_LOCK:
        _SHARED[key] = loaded
        while len(_SHARED) > _SHARED_KEEP:
            _SHARED.popitem(last=False)
    return loaded
