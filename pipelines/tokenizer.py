"""The one tokenizer loader, the label value that takes no loss, and the tokenizer's fingerprint.

Everything that needs the configured tokenizer (the tokenizer actors, ``convert.py --tokenize``, the
training workers, the MDS tokenizer check) loads it here, so all of them see the same tokenizer with
the same settings: ``demo://tokenizer`` made local, a pad token (the EOS token where the tokenizer
has none; padding never reaches the loss), never the Hub at run time.
"""

from __future__ import annotations

import hashlib
import logging
from typing import TYPE_CHECKING, Any

from pipelines.config import ModelConfig

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["IGNORE_INDEX", "load_tokenizer", "resolve_tokenizer_path", "tokenizer_fingerprint", "tokenizer_sha256"]

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
    """The configured Hugging Face tokenizer (local directory or cached id), with a pad token."""
    from transformers import AutoTokenizer

    if model.trust_remote_code:
        logger.warning("model.trust_remote_code is on: code shipped with %s will run", model.tokenizer_path)
    tok = AutoTokenizer.from_pretrained(resolve_tokenizer_path(model), trust_remote_code=model.trust_remote_code)
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
