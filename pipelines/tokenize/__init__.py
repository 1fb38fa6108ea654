"""Tokenize: text and spans -> token ids and labels, in the CPU stage of the stream.

* :mod:`~pipelines.tokenize.tokenizer`: the one tokenizer loader, ``IGNORE_INDEX`` and the tokenizer's fingerprint;
* :mod:`~pipelines.tokenize.labels`: trained character spans -> labels on tokens;
* :mod:`~pipelines.tokenize.pretokenized`: samples that arrive as token ids, and their checks;
* :mod:`~pipelines.tokenize.stage`: the stage itself, record blocks -> ``(sample_id, input_ids, labels)``.
"""
