"""MosaicML MDS as a source and a sink of the pipeline.

* :mod:`~pipelines.mds.index`: ``index.json`` checks and one source file per shard;
* :mod:`~pipelines.mds.reader`: fetching, checking and decoding shards in read tasks, and the tokenizer check
  of pre-tokenized sets;
* :mod:`~pipelines.mds.writer`: :class:`~pipelines.mds.writer.MDSDatasink`, writing a Ray Dataset as MDS;
* :mod:`~pipelines.mds.codec`: mosaic-streaming's encodings, compression and hashing.

Nothing is imported here: the MDS modules load only where MDS is read or written.
"""
