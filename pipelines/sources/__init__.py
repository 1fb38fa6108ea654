"""Sources and formats: where records come from and how one record becomes text with trained spans.

* :mod:`~pipelines.sources.listing`: each dataset's path -> files, and the stable sample id of every record;
* :mod:`~pipelines.sources.datasource`: the Ray Data ``Datasource`` whose read tasks own whole files;
* :mod:`~pipelines.sources.records`: the record layout between read tasks and the tokenizer;
* :mod:`~pipelines.sources.formats`: a record -> text plus the character spans that carry labels;
* :mod:`~pipelines.sources.chat_messages`, :mod:`~pipelines.sources.chat_template`: chat records, rendered
  with the tokenizer's own template.
"""
