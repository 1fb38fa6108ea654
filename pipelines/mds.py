"""MosaicML MDS as a source and a sink of the pipeline; the parts live in their own modules.

* :mod:`pipelines.mds_index`: ``index.json`` checks and one source file per shard;
* :mod:`pipelines.mds_reader`: fetching, checking and decoding shards in read tasks; the tokenizer check
  of pre-tokenized sets;
* :mod:`pipelines.mds_sink`: :class:`MDSDatasink`, writing a Ray Dataset as MDS.

This module re-exports their public names (``from pipelines.mds import MDSDatasink``).
"""

from __future__ import annotations

from pipelines.mds_index import INDEX, TOKENIZED_META, MDSError, expand_mds, load_index, read_tokenized_meta
from pipelines.mds_reader import check_tokenized_sources, fetch_shard, read_mds, sample_to_record
from pipelines.mds_sink import MDSDatasink, encoding_for, infer_columns
from pipelines.tokenizer import tokenizer_fingerprint, tokenizer_sha256

__all__ = [
    "INDEX",
    "TOKENIZED_META",
    "MDSDatasink",
    "MDSError",
    "check_tokenized_sources",
    "encoding_for",
    "expand_mds",
    "fetch_shard",
    "infer_columns",
    "load_index",
    "read_mds",
    "read_tokenized_meta",
    "sample_to_record",
    "tokenizer_fingerprint",
    "tokenizer_sha256",
]
