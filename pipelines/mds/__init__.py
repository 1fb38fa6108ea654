"""MosaicML MDS as a source and a sink of the pipeline.

* :mod:`~pipelines.mds.index`: ``index.json`` checks and one source file per shard;
* :mod:`~pipelines.mds.reader`: fetching, checking and decoding shards in read tasks, and the tokenizer check
  of pre-tokenized sets;
* :mod:`~pipelines.mds.writer`: :class:`~pipelines.mds.writer.MDSDatasink`, writing a Ray Dataset as MDS;
* :mod:`~pipelines.mds.encodings`: column values <-> bytes;
* :mod:`~pipelines.mds.compression`: shard compression and hashes.

The format is MosaicML Streaming's (MDS, index version 2), implemented here so the core install does not
depend on ``mosaicml-streaming`` (whose release pins transformers<5 and numpy<2.2); sets written by
either side read on the other (tests/test_mds_codec.py).

Nothing is imported here: the MDS modules load only where MDS is read or written.
"""
