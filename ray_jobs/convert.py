"""Convert JSONL / JSON / Parquet (local or s3:// / gs://) to MosaicML MDS shards, in parallel on Ray.

Two modes:

raw (default)
    The records as they are, same columns. Encodings are chosen from the first records
    (``--sample-records``): str, int64, float64 where every value fits, json otherwise; set any
    with ``--columns name=encoding``. Row order follows the sorted input files.

        python ray_jobs/convert.py --input 's3://bucket/raw/*.jsonl' --output s3://bucket/mds/raw

--tokenize
    Tokenized once with the config's tokenizer, dataset types and templates (``data.datasets``), so
    training runs and epochs skip tokenization. Writes ``input_ids``, ``labels`` (ndarray:int32) and
    ``source_sample_id`` (int64; pipelines.sources.listing.locate_sample style id of the source record), plus
    ``tokenized.json`` next to ``index.json``: tokenizer name and sha256 of its tokenizer.json,
    dataset types/templates, sequence_len and the source paths. ``build_dataset`` reads such a set
    like any MDS source (``format: mds``), skips tokenization, and refuses it if ``model.tokenizer``
    is a different tokenizer.

        python ray_jobs/convert.py --tokenize --config configs/sft.yaml --output s3://bucket/mds/sft-gpt2

Object storage: endpoint and region from ``--endpoint-url`` / ``--region``, the config's ``storage:``
section, or the AWS environment (``AWS_ENDPOINT_URL``, ``AWS_REGION``); credentials only from the
environment / AWS config files. Shards: zstd by default, xxh64 hashes, 64 MiB per shard; each
write task writes ``part-NNNNN/`` and one merged ``index.json`` is written last. With ``--tokenize``
and at least as many files as write tasks, each task reads a group of whole files, tokenizes and
writes it (:func:`tokenize_in_tasks`); otherwise the reads feed a pool of tokenizer actors.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # `python ray_jobs/convert.py` from a checkout without `pip install -e .`
    sys.path.insert(0, str(REPO_ROOT))

from pipelines.config import Config, ConfigError, DataConfig, DatasetConfig, StorageConfig, load_config  # noqa: E402
from pipelines.sources.listing import SourceError, SourceFile, SourceTable, resolve_dataset  # noqa: E402
from pipelines.storage import StorageError, StorageOptions  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import init_ray  # noqa: E402  (join or start Ray, as the other job scripts do)

TOKENIZED_COLUMNS = {"input_ids": "ndarray:int32", "labels": "ndarray:int32", "source_sample_id": "int64"}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="convert.py", description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--input", action="append", default=[], metavar="PATH",
                   help="raw mode: file, directory, glob or s3:// / gs:// URL (repeatable)")
    p.add_argument("--format", default="auto", choices=["auto", "jsonl", "json", "parquet"], help="raw mode: input format")
    p.add_argument("--output", required=True, help="MDS directory to write (local path or s3:// / gs:// URL)")
    p.add_argument("--tokenize", action="store_true", help="tokenize with --config's tokenizer and templates")
    p.add_argument("--config", help="YAML config (required with --tokenize; its storage: section is used if given)")
    p.add_argument("--split", default="train", choices=["train", "eval"], help="--tokenize: which datasets of the config")
    p.add_argument("--columns", action="append", default=[], metavar="NAME=ENCODING",
                   help="raw mode: MDS encoding of a column (str, int64, float64, json, ...), overriding inference")
    p.add_argument("--sample-records", type=int, default=1000, help="raw mode: records used to choose encodings")
    p.add_argument("--compression", default="zstd", help="shard compression (zstd, zstd:9, gz, none, ...)")
    p.add_argument("--hashes", default="xxh64", help="comma-separated shard hashes (e.g. sha1,xxh64; none)")
    p.add_argument("--size-limit", default="64mb", help="shard size before compression (bytes or e.g. 64mb)")
    p.add_argument("--write-tasks", type=int, default=0, help="parallel read/write tasks (0: one per CPU)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing MDS dataset at --output")
    p.add_argument("--endpoint-url", help="S3-compatible endpoint (else config storage: or AWS_ENDPOINT_URL)")
    p.add_argument("--region", help="S3 region (else config storage: or AWS_REGION)")
    p.add_argument("--retries", type=int, help="retries for transient object-store errors (default 5)")
    p.add_argument("overrides", nargs="*", help="--tokenize: dotted key=value config overrides")
    args = p.parse_args(argv)
    if args.tokenize and not args.config:
        p.error("--tokenize needs --config (tokenizer, dataset types and templates)")
    if not args.tokenize and not args.input:
        p.error("raw mode needs at least one --input")
    if args.tokenize and args.input:
        p.error("--tokenize reads the config's data.datasets; set paths there or override data.datasets.0.path=...")
    return args


def storage_options(args: argparse.Namespace, base: StorageConfig | None) -> StorageOptions:
    """Command-line flags over the config's storage: section over the AWS environment."""
    cfg = (base or StorageConfig()).model_copy()
    for key, value in (("endpoint_url", args.endpoint_url), ("region", args.region), ("retries", args.retries)):
        if value is not None:
            setattr(cfg, key, value)
    return StorageOptions.from_config(cfg)


def raw_table(inputs: list[str], fmt: str, opts: StorageOptions) -> SourceTable:
    """The input files of raw mode, numbered like a config's datasets (one dataset per --input)."""
    datasets, files = [], []
    for d_idx, path in enumerate(inputs):
        ds = DatasetConfig(path=path, format=fmt)
        datasets.append(ds)
        for fs_path, url, file_fmt, size, meta in resolve_dataset(ds, os.getcwd(), opts):
            if file_fmt == "mds":
                raise SourceError(f"--input {path!r} is already MDS")
            files.append(SourceFile(len(files), d_idx, fs_path, url, file_fmt, size, meta))
    return SourceTable(tuple(files), tuple(datasets), opts)


def parse_columns(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        name, sep, enc = item.partition("=")
        if not sep or not name or not enc:
            raise ConfigError(f"--columns {item!r} is not NAME=ENCODING")
        out[name] = enc
    return out


def first_records(table: SourceTable, opts: Any, n: int) -> list[str]:
    """The first ``n`` records of the first file, as the JSON strings the read stage makes of them."""
    from itertools import islice

    from pipelines.sources.read import read_all_records

    first = SourceTable(table.files[:1], table.datasets, table.storage)
    return [rec for _, rec in islice(read_all_records(first, opts), n)]


def choose_columns(table: SourceTable, records: list[str], given: dict[str, str]) -> dict[str, str]:
    """Encodings from the first records (:func:`first_records`), overridden by ``given``."""
    from pipelines.mds.writer import infer_columns

    if not records:
        raise SourceError(f"{table.files[0].url}: no records to choose column encodings from")
    return {**infer_columns(json.loads(rec) for rec in records), **given}


def rows_per_part(records: list[str], size_limit: int, unit_records: int | None = None) -> int | None:
    """Rows a write task takes at least (the sink's ``min_rows_per_write``): two shards of input bytes,
    by the mean size of the first records; ``None`` without records.

    Blocks leave the reads, and the tokenizer, every ``READ_BLOCK_BYTES`` (4 MB), so the writes run beside
    them. Without this floor every block would be a part of its own, whose shard stays far under
    ``--size-limit``; with it a part holds about two shards of raw records, about four tokenized
    (``input_ids`` + ``labels``, 8 bytes a token, is about twice the text). Raw mode's blocks hold one
    row per read unit of up to ``unit_records`` records (the sink splits them), so the floor counts units.
    Example: records of 1,800 bytes, ``--size-limit 64mb`` -> 74,566 rows a part (``4mb``: 4,661); in
    units of 4,096 records, 19.
    """
    from pipelines.sources.read import MAX_UNIT_BYTES

    if not records:
        return None
    mean = sum(len(rec.encode("utf-8")) for rec in records) / len(records)
    rows = math.ceil(2 * size_limit / mean)
    if unit_records:
        rows = math.ceil(rows / min(unit_records, max(1, int(MAX_UNIT_BYTES // mean))))
    return max(1, rows)


def tokenize_in_tasks(placement: str, n_files: int, tasks: int) -> bool:
    """Whether ``--tokenize`` tokenizes in the read tasks, each writing its own part, as mosaic's
    ``multiprocessing.Pool`` conversion does: ``data.tokenize.placement`` ``read_tasks``, or ``auto`` with at
    least as many files as tasks (each task then takes a group of whole files). Otherwise (``actors``, or
    fewer files than tasks) the reads hand their blocks to a pool of tokenizer actors and the write tasks
    take them from there, so one large file is still tokenized by every actor.

    Example: 16 files, 2 tasks -> in the tasks (two parts of 8 files each); one file -> actors.
    """
    return placement == "read_tasks" or (placement == "auto" and n_files >= tasks)


def tokenized_meta(cfg: Config, table: SourceTable) -> dict[str, Any]:
    """What produced a tokenized set (written as tokenized.json); checked by build_dataset."""
    from pipelines.sources.formats import ALPACA_PROMPT, ALPACA_PROMPT_NO_INPUT, ALPACA_TURN
    from pipelines.tokenize.tokenizer import load_tokenizer, tokenizer_sha256

    hf = load_tokenizer(cfg.model)
    return {
        "format_version": 1,
        "created_by": "ray_jobs/convert.py --tokenize",
        "tokenizer": {"name": cfg.model.tokenizer_path, "sha256": tokenizer_sha256(hf), "vocab_size": len(hf)},
        "template": {
            "datasets": [ds.model_dump(mode="json") for ds in table.datasets],
            "alpaca_prompts": [ALPACA_PROMPT, ALPACA_PROMPT_NO_INPUT, ALPACA_TURN],
            "chat_template": getattr(hf, "chat_template", None),
        },
        "sequence_len": cfg.data.sequence_len,
        "add_eos": cfg.data.add_eos,
        "train_on_inputs": cfg.data.train_on_inputs,
        "sources": [f.url for f in table.files],
        "columns": TOKENIZED_COLUMNS,
    }


def convert(args: argparse.Namespace) -> dict[str, Any]:
    """Run one conversion; returns what was written (rows, shards, parts, seconds)."""
    import ray

    from pipelines.mds.writer import MDSDatasink, parse_size
    from pipelines.sources.datasource import ShardDatasource
    from pipelines.sources.read import ReadOptions
    from pipelines.stats import StatsSink, format_report, stats_sink
    from pipelines.stream.dataset import read_task_args, tokenizer_in_read_tasks, tokenizer_stage
    from pipelines.stream.placement import tokenizer_threads
    from pipelines.stream.spec import build_spec
    from pipelines.stream.stages import STORED_SCHEMA, TokenizeToStore, stored_columns
    from pipelines.stream.units import READ_BLOCK_BYTES

    t0 = time.perf_counter()
    cfg = load_config(args.config, args.overrides) if args.config else None
    opts = storage_options(args, cfg.storage if cfg else None)
    if args.tokenize:
        assert cfg is not None
        cfg.storage = StorageConfig(endpoint_url=opts.endpoint_url, region=opts.region, retries=opts.retries)
        spec = build_spec(cfg, args.split)
        table = spec.table
    else:
        table = raw_table(args.input, args.format, opts)
    read_opts = ReadOptions(storage=opts, on_bad_record=cfg.data.on_bad_record if cfg else "raise",
                            text_fields=tuple(ds.text_field for ds in table.datasets), unit_size=4096)
    compression = None if args.compression in ("", "none") else args.compression
    hashes = [h for h in args.hashes.split(",") if h and h != "none"]
    tasks = args.write_tasks or max(1, int(ray.cluster_resources().get("CPU", 1)))
    # Read, filter and write tasks ask data.read_num_cpus (small, so they run beside the tokenizer actors).
    worker_cpus = cfg.data.read_num_cpus if cfg else DataConfig.model_fields["read_num_cpus"].default
    order = list(range(len(table.files)))
    sample = first_records(table, read_opts, args.sample_records)
    common = {"compression": compression, "hashes": hashes, "size_limit": args.size_limit, "storage": opts,
              "overwrite": args.overwrite}
    write_args: dict[str, Any] = {"num_cpus": worker_cpus}
    if args.tokenize:
        assert cfg is not None
        sink_stats = stats_sink()
        meta = json.dumps(tokenized_meta(cfg, table), indent=1).encode("utf-8")
        tok = spec.placement.tokenize
        fused = tokenize_in_tasks(tok.placement, len(order), tasks)
    else:
        sink_stats, fused = StatsSink(), False
    if fused:
        # Read, tokenize and write in one task per group of files, `tasks` at once, as mosaic's Pool does: no
        # block crosses the object store, and each task writes its own part (Ray Data fuses the write into the
        # read tasks, as their remote arguments and concurrency are the same).
        threads = tokenizer_threads(tok, tasks, spec.placement.cpus)  # auto: the CPUs per task
        stage = tokenizer_in_read_tasks(TokenizeToStore, {"data": cfg.data, "model": cfg.model, "table": table,
                                                          "sink": sink_stats}, threads)
        write_args = read_task_args(spec.placement, stage)
        source = ShardDatasource(table, order, read_opts, sink_stats, stage=stage, stage_schema=STORED_SCHEMA,
                                 first_unit_task=False)
        ds = ray.data.read_datasource(source, override_num_blocks=min(len(order), tasks), concurrency=tasks,
                                      **write_args)
    else:
        source = ShardDatasource(table, order, read_opts, StatsSink(), first_unit_task=False)  # no first row to hurry
        ds = ray.data.read_datasource(source, override_num_blocks=max(1, min(len(order), tasks)), num_cpus=worker_cpus,
                                      concurrency=spec.placement.reads_at_once(token_ids=False) if args.tokenize else None)
        # Units leave the read tasks as they are read (Ray's default would hold a task's blocks up to 128 MB:
        # the tokenizer would wait for whole read tasks, and the writes for the whole tokenizer stage).
        ds.context.target_max_block_size = READ_BLOCK_BYTES
        common["min_rows_per_write"] = rows_per_part(sample, parse_size(args.size_limit),
                                                     None if args.tokenize else read_opts.unit_size)
        if args.tokenize:
            ds = tokenizer_stage(ds, spec, sink_stats)
            ds = ds.map_batches(stored_columns, batch_size=None, batch_format="pyarrow", num_cpus=worker_cpus)
    ds.context.execution_options.preserve_order = True
    if args.tokenize:
        sink = MDSDatasink(args.output, TOKENIZED_COLUMNS, extra_files={"tokenized.json": meta}, **common)
    else:
        columns = choose_columns(table, sample, parse_columns(args.columns))
        sink = MDSDatasink(args.output, columns, record_column="record", locate=table.where, **common)
    # Streamed, the write tasks are as small as the reads (Ray's default, 1 CPU, waits for the tokenizer actor's
    # CPU: the writes would only start when tokenizing is over), at most --write-tasks at a time. An input of
    # fewer parts than that is not a mistake, so Ray's warning about it is not shown.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The maximum number of concurrent tasks for 'Write'")
        ds.write_datasink(sink, ray_remote_args=write_args, concurrency=tasks)
    result = {**sink.written, "seconds": round(time.perf_counter() - t0, 2), "output": args.output,
              "mode": "tokenize" if args.tokenize else "raw"}
    if args.tokenize:
        result["report"] = format_report(sink_stats.snapshot())
    else:
        result["columns"] = sink.columns
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from pipelines.errors import BadRecordError
    from pipelines.mds.index import MDSError

    try:
        init_ray()
        result = convert(args)
    except (ConfigError, SourceError, MDSError, StorageError, BadRecordError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    report = result.pop("report", None)
    print(json.dumps(result))
    if report:
        print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
