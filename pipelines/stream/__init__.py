"""The stream: tokenized samples -> packed rows -> one mixed, resumable sequence of training steps.

* :mod:`~pipelines.stream.spec`: :class:`~pipelines.stream.spec.StreamSpec`, what a run streams, built once;
* :mod:`~pipelines.stream.units`: packing units and resume points;
* :mod:`~pipelines.stream.packing`: samples -> rows of at most ``sequence_len`` tokens;
* :mod:`~pipelines.stream.dataset`: the stages wired into one lazy Ray Dataset per source;
* :mod:`~pipelines.stream.mixing`: token-weighted mixing of the sources;
* :mod:`~pipelines.stream.state`: the typed data position (:class:`~pipelines.stream.state.DataState`);
* :mod:`~pipelines.stream.ledger`: what was trained on, step by step;
* :mod:`~pipelines.stream.batch`: the global batch of a step and each rank's share, at any world size;
* :mod:`~pipelines.stream.feeder`: the actor that serves every rank its rows, and owns the position.
"""
