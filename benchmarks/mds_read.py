"""MDS read and conversion benchmark: ``build_dataset`` vs mosaic's own loader, local disk and S3.

    python benchmarks/mds_read.py            # reads: >= 50 MB of real text (uncompressed); convert: >= 200 MB
    python benchmarks/mds_read.py --quick    # ~2 MB: a smoke run of every measurement

Data: the Alpaca and LIMA records of ../shared/data (alpaca format), replicated to the target size,
written once as JSONL files and as MDS shards (zstd; our writer, which writes the bytes mosaic's ``MDSWriter`` writes), the shards also uploaded
to a ``moto_server`` on 127.0.0.1 (started and stopped here). Each measurement runs in its own child
process (``--child NAME``) so imports, ``ray.init`` and memory never leak between systems:

* ``ours_local`` / ``ours_s3``: ``build_dataset`` (read + decode + format + tokenize + concat-pack to
  2048 tokens) iterated to the end; Ray start-up is reported separately (``init_s``). Ours runs with the
  default config (tokenizer pool, read tasks), as a user gets it; until 2026-12-03 it ran a pool of
  2 actors x 0.75 CPU (1 Rust thread each) with 2 read tasks, ~12% slower here than the default.
* ``mosaic_local`` / ``mosaic_s3``: ``StreamingDataset`` + ``DataLoader(num_workers=2)``, each sample
  formatted with the same alpaca template and tokenized in ``__getitem__`` (no label masks: less
  work than ours), concatenated into 2048-token rows in the main process. Local shards are read in
  place (``local=`` only); the tokenizer and the dataset object are made before the clock starts.
* ``*_tok_*``: pre-tokenized data, made here before any clock: nobody tokenizes. MDS in llm-foundry's
  concatenated-tokens layout (one ``tokens: ndarray:int32`` column of 2048-token samples, zstd as its README
  converts), and LitData's own offline format (``optimize`` with ``TokensLoader()`` and its README's chunk size,
  uncompressed, its default) of the same token stream. Locally each set is ``--tok-mtokens`` (500 M) tokens:
  hard-linked copies of one ~13 M-token set, so the page cache holds one copy for every system alike; on S3
  the one set. Ours is training's path: the feeder, which reads such a source in its own process, serving one
  rank 64-row steps that the rank fetches (``ours_feeder``), on the zstd MDS and (``ours_tok_local_raw``) on
  the same MDS without compression. Mosaic's is llm-foundry's: a ``StreamingDataset`` subclass returning the
  ``tokens`` array, iterated through the base class's ``__iter__`` (shard predownload, its defaults) by
  ``DataLoader(num_workers=2)``, 64 samples a batch; the shards it decompresses next to a local set are
  removed before each run (it keeps them when there is no remote, so a second run would skip the work ours
  does every time). LitData's is its README's pre-training loader: ``StreamingDataset(item_loader=
  TokensLoader(block_size=2048))`` + ``StreamingDataLoader(num_workers=2)``, 64 rows a batch.
  ``ours_tok_local_inproc`` runs the feeder's code in the consumer's process instead of an actor (one consumer
  needs no actor; training's ranks share one), which separates the actor's start and calls from the reading.
* ``convert``: ``ray_jobs/convert.py --tokenize`` (2 write tasks) JSONL -> tokenized MDS, vs two peers
  that read the same JSONL, format each record with the same template, tokenize in batches of 1,000
  (``encode_batch_fast``: ids only) and write ``input_ids`` with ``MDSWriter`` (no label masks: less
  work than ours):

  - ``mosaic_procs``: mosaic's documented parallel conversion ("Parallel dataset conversion", option 2):
    a ``multiprocessing.Pool`` of as many processes as our write tasks (2), each converting its
    contiguous group of files into ``out/<k>`` with its own ``MDSWriter`` and a one-thread tokenizer,
    then ``streaming.base.util.merge_index(out)``. The clock covers the pool's start (each process
    loads its tokenizer, as each of our tasks does) and the merge.
  - ``tokenize_loop``: one process, the tokenizer's own Rust threads (2; ``TOKENIZERS_PARALLELISM``
    on), the tokenizer loaded before the clock.

  The better of the two is "the peer". All convert their own, larger JSONL set (``--convert-mb``,
  200 MB, so that neither side's fixed costs decide). ``convert_stages`` (case ``stages``; not a peer) runs
  ours' stages in one process and one thread without Ray, to separate their cost from that of running them
  through Ray.

Runs are interleaved: each round runs every case once, in the same order, and a case's figures are the
median of its rounds, with the spread (min-max of total seconds) beside it. ``--cases`` picks a subset
(``read``, ``tok``, ``convert``, ``stages``). Ratios > 1 mean ours is faster. Every system sees the same cores.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("PIPELINES_SHARED_DATA", ROOT.parent / "shared" / "data"))
SOURCES = [SHARED / "sft" / "alpaca_en_demo.json", SHARED / "sft" / "lima.json"]
GPT2 = SHARED / "tokenizers" / "gpt2"
SEQ_LEN = 2048
COLUMNS = {"instruction": "str", "input": "str", "output": "str", "history": "json"}
BUCKET = "mds-bench"
TAG = "MDS_BENCH "
ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error",
       "RAY_USAGE_STATS_ENABLED": "0", "PYTHONWARNINGS": "ignore", "TOKENIZERS_PARALLELISM": "false",
       "AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench-secret", "AWS_REGION": "us-east-1"}


# --------------------------------------------------------------------------- data


def records() -> list[dict[str, Any]]:
    """The real alpaca-format records, with the columns the MDS set holds."""
    out = []
    for path in SOURCES:
        for r in json.loads(path.read_text()):
            out.append({"instruction": r["instruction"], "input": r.get("input") or "", "output": r["output"],
                        "history": r.get("history") or None})
    return out


def replicated(target_mb: float) -> tuple[list[dict[str, Any]], int]:
    """The records repeated until their JSON takes ``target_mb`` MB; and how many copies that is."""
    base = records()
    one = sum(len(json.dumps(r)) for r in base)
    copies = max(1, int(target_mb * 1e6 / one + 0.999))
    return [r for _ in range(copies) for r in base], copies


def write_jsonl(out: Path, rows: list[dict[str, Any]], files: int) -> None:
    """``rows`` as ``files`` JSONL files of about equal length."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    per = -(-len(rows) // files)
    for k in range(files):
        part = rows[k * per : (k + 1) * per]
        (out / f"part-{k:03d}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))


def prepare_convert(work: Path, target_mb: float, files: int) -> dict[str, Any]:
    """The conversion case's own JSONL (larger than the read cases': the issue asks for the largest
    corpus this machine holds comfortably, ~200 MB, so the fixed costs of either side do not decide)."""
    rows, copies = replicated(target_mb)
    out = work / "jsonl_convert"
    write_jsonl(out, rows, files)
    return {"convert_samples": len(rows), "convert_copies": copies,
            "convert_mb": sum(f.stat().st_size for f in out.glob("*.jsonl")) / 1e6}


def prepare(work: Path, target_mb: float, shard_bytes: int, files: int) -> dict[str, Any]:
    """JSONL files and zstd MDS shards of the records replicated to ``target_mb`` (uncompressed)."""
    from pipelines.mds.writer import ShardWriter  # mosaic's MDSWriter's bytes (tests/test_mds_codec.py)

    rows, copies = replicated(target_mb)
    mds = work / "mds"
    shutil.rmtree(work, ignore_errors=True)
    write_jsonl(work / "jsonl", rows, files)
    with ShardWriter(out=str(mds), columns=COLUMNS, compression="zstd", hashes=["xxh64"], size_limit=shard_bytes) as w:
        for r in rows:
            w.write(r)
    index = json.loads((mds / "index.json").read_text())
    raw = sum(s["raw_data"]["bytes"] for s in index["shards"])
    zipped = sum(s["zip_data"]["bytes"] for s in index["shards"])
    return {"samples": len(rows), "copies": copies, "shards": len(index["shards"]), "raw_mb": raw / 1e6,
            "zstd_mb": zipped / 1e6, "jsonl_files": files}


def _alpaca_texts(rows: list[dict[str, Any]]) -> list[str]:
    from pipelines.config import DataConfig, DatasetConfig
    from pipelines.sources.formats import make_formatter

    ds = DatasetConfig(path="x", type="alpaca")
    fmt = make_formatter(ds, DataConfig(datasets=[ds]), None)
    return [fmt({k: v for k, v in r.items() if v is not None}).text for r in rows]


def prepare_tokens(work: Path, shard_bytes: int) -> dict[str, Any]:
    """llm-foundry's concatenated-tokens MDS of the same records: GPT-2 ids (+ EOS per document),
    concatenated and cut into SEQ_LEN-token samples (``tokens: ndarray:int32``)."""
    import numpy as np
    from tokenizers import Tokenizer

    from pipelines.mds.writer import ShardWriter

    sys.path.insert(0, str(ROOT))
    tok = Tokenizer.from_file(str(GPT2 / "tokenizer.json"))
    tok.no_truncation()
    eos = tok.token_to_id("<|endoftext|>")
    writers = {}
    for name, compression in (("mds_tokens", "zstd"), ("mds_tokens_raw", None)):  # zstd: llm-foundry's README
        shutil.rmtree(work / name, ignore_errors=True)
        writers[name] = ShardWriter(out=str(work / name), columns={"tokens": "ndarray:int32"},
                                    compression=compression, hashes=["xxh64"], size_limit=shard_bytes)
    samples, buf = 0, np.zeros(0, np.int32)
    for path in sorted((work / "jsonl").glob("*.jsonl")):
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        ids = [np.asarray(e.ids + [eos], np.int32) for e in tok.encode_batch(_alpaca_texts(rows))]
        buf = np.concatenate([buf, *ids])
        k = len(buf) // SEQ_LEN
        for i in range(k):
            for w in writers.values():
                w.write({"tokens": buf[i * SEQ_LEN : (i + 1) * SEQ_LEN]})
        samples, buf = samples + k, buf[k * SEQ_LEN :]
    if len(buf):
        for w in writers.values():
            w.write({"tokens": buf})
        samples += 1
    for w in writers.values():
        w.finish()
    return {"token_samples": samples}


def _litdata_tokenize(path: str) -> Any:
    """LitData's documented tokenize function for ``optimize`` (its LLM pre-training example): one JSONL file in,
    its documents' GPT-2 ids (+ EOS each) out, as one int32 array that ``TokensLoader`` concatenates."""
    import numpy as np
    from tokenizers import Tokenizer

    sys.path.insert(0, str(ROOT))
    tok = Tokenizer.from_file(str(GPT2 / "tokenizer.json"))
    tok.no_truncation()
    eos = tok.token_to_id("<|endoftext|>")
    rows = [json.loads(line) for line in Path(path).read_text().splitlines()]
    yield np.concatenate([np.asarray(e.ids + [eos], np.int32) for e in tok.encode_batch(_alpaca_texts(rows))])


def prepare_litdata_tokens(work: Path) -> dict[str, Any]:
    """LitData's offline path, as its README's LLM pre-training example runs it: ``optimize`` of the same JSONL
    with ``TokensLoader()`` and its chunk size (2049 x 8012 tokens), 2 workers; no clock."""
    import litdata

    out = work / "litdata_tokens"
    shutil.rmtree(out, ignore_errors=True)
    litdata.optimize(fn=_litdata_tokenize, inputs=[str(f) for f in sorted((work / "jsonl").glob("*.jsonl"))],
                     output_dir=str(out), chunk_size=2049 * 8012, item_loader=litdata.TokensLoader(), num_workers=2,
                     verbose=False)
    index = json.loads((out / "index.json").read_text())
    return {"litdata_tokens": sum(c["dim"] for c in index["chunks"]), "litdata_chunks": len(index["chunks"])}


def _empty_copy_of(src: Path, dst: Path) -> dict[str, Any]:
    """``src``'s ``index.json``, with ``dst`` made an empty directory for a copy of the set."""
    shutil.rmtree(dst, ignore_errors=True)
    dst.mkdir(parents=True)
    return json.loads((src / "index.json").read_text())


def replicate_mds(src: Path, dst: Path, copies: int) -> int:
    """``copies`` of the MDS set ``src`` as one set ``dst``: its shard files hard-linked under new names, its
    index listing them all (issue 43: hard-linked shards are fine for scale). Returns the shard count."""
    index = _empty_copy_of(src, dst)
    shards = []
    for _ in range(copies):
        for shard in index["shards"]:
            shard = json.loads(json.dumps(shard))
            number = len(shards)
            for key in ("raw_data", "zip_data"):
                old = (shard.get(key) or {}).get("basename")
                if old is None:
                    continue
                new = f"shard.{number:05d}." + old.split(".", 2)[2]  # shard.00000.mds(.zstd)
                if (src / old).exists():
                    os.link(src / old, dst / new)
                shard[key]["basename"] = new
            shards.append(shard)
    (dst / "index.json").write_text(json.dumps({**index, "shards": shards}))
    return len(shards)


def replicate_litdata(src: Path, dst: Path, copies: int) -> int:
    """``copies`` of LitData's optimized set ``src`` as one set ``dst`` (chunks hard-linked, one index)."""
    index = _empty_copy_of(src, dst)
    chunks = []
    for k in range(copies):
        for chunk in index["chunks"]:
            new = f"chunk-{k}-{chunk['filename']}"
            os.link(src / chunk["filename"], dst / new)
            chunks.append({**chunk, "filename": new})
    (dst / "index.json").write_text(json.dumps({**index, "chunks": chunks}))
    return len(chunks)


def drop_decompressed(local: Path) -> None:
    """Remove the raw shards mosaic decompressed next to their ``.zstd`` in a local-only set (it keeps them when
    ``remote`` is None, so its next run would skip decompressing): every run starts from the compressed
    shards, as ours does, which decompresses each time."""
    for zipped in local.glob("*.mds.zstd"):
        zipped.with_suffix("").unlink(missing_ok=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_moto() -> tuple[subprocess.Popen, str]:
    port = free_port()
    exe = Path(sys.executable).with_name("moto_server")
    proc = subprocess.Popen([str(exe), "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    for _ in range(300):
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return proc, f"http://127.0.0.1:{port}"
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("moto_server did not start")


def upload(local: Path, endpoint: str, dest: str) -> str:
    import pyarrow.fs as pafs

    fs = pafs.S3FileSystem(endpoint_override=endpoint.split("://")[1], scheme="http", region="us-east-1",
                           access_key=ENV["AWS_ACCESS_KEY_ID"], secret_key=ENV["AWS_SECRET_ACCESS_KEY"],
                           allow_bucket_creation=True)
    fs.create_dir(dest.split("/")[0])
    pafs.copy_files(str(local), dest, source_filesystem=pafs.LocalFileSystem(), destination_filesystem=fs)
    return f"s3://{dest}"


# --------------------------------------------------------------------------- systems (child processes)


def _start_ours(p: dict[str, Any], dataset_type: str) -> tuple[Any, float]:
    """Ours' set-up: ``ray.init`` (timed, reported apart as start-up) and the config over ``p["path"]``."""
    sys.path.insert(0, str(ROOT))
    from pipelines.config import config_from_dict
    from pipelines.ray_local import init_local

    t0 = time.perf_counter()
    init_local(num_cpus=2, include_dashboard=False, log_to_driver=False)
    init = time.perf_counter() - t0
    cfg = config_from_dict({
        "model": {"tokenizer": str(GPT2)},
        "data": {"datasets": [{"path": p["path"], "format": "mds", "type": dataset_type}],
                 "sequence_len": SEQ_LEN, "packing": "concat", **p.get("data", {})},
        "storage": {"endpoint_url": p.get("endpoint"), "retries": 5},
    })
    return cfg, init


def _count_ours(batches: Any, init: float) -> dict[str, Any]:
    """Run ours to the end: ``batches`` yields each delivered batch's row lengths (``input_ids``), lazily, so
    the clock starts here; Ray is shut down after."""
    import ray

    t = time.perf_counter()
    rows = tokens = first_tokens = 0
    first = None
    for lengths in batches:
        rows += len(lengths)
        tokens += int(sum(lengths))
        if first is None:
            first, first_tokens = time.perf_counter() - t, tokens
    total = time.perf_counter() - t
    ray.shutdown()
    return {"init_s": init, "ttfb_s": first, "total_s": total, "rows": rows, "tokens": tokens,
            "first_tokens": first_tokens}


def run_ours(p: dict[str, Any]) -> dict[str, Any]:
    """Raw-text MDS through ``build_dataset`` (read, format, tokenize, pack), iterated to the end."""
    import pyarrow.compute as pc

    cfg, init = _start_ours(p, "completion" if p.get("tokens") else "alpaca")
    from benchlib import iter_ray_blocks

    from pipelines.stream.dataset import build_dataset

    def batches() -> Any:
        for batch in iter_ray_blocks(build_dataset(cfg)):
            yield pc.list_value_length(batch.column("input_ids")).to_numpy()  # no per-token Python

    return _count_ours(batches(), init)


def run_ours_feeder(p: dict[str, Any]) -> dict[str, Any]:
    """Pre-tokenized MDS as training reads it: the feeder (which reads such a source in its own process) serves
    one rank 64-row steps, and the rank fetches each step's rows (numpy views of the object store)."""
    cfg, init = _start_ours(p, "completion")
    from pipelines.stream.client import FeederClient
    from pipelines.stream.feeder import Feeder, start_feeder
    from pipelines.stream.spec import build_spec

    def steps() -> Any:
        if p.get("in_process"):  # the feeder's code in this process, as mosaic's loader is: no actor to start
            feeder, index = Feeder(build_spec(cfg, "train"), 1, 64, 1), 0
            while items := feeder.get(index, 0, most=8):
                index += len(items)
                yield from items
        else:
            client = FeederClient(start_feeder(cfg, 1, 64, None, None, epochs=1), 0)
            while (item := client.next()) is not None:
                yield item

    def batches() -> Any:
        for item in steps():
            if item.kind == "step":
                yield [len(r) for r in item.columns(("input_ids",))["input_ids"]]

    return _count_ours(batches(), init)


class _TokenizingDataset:
    """mosaic's StreamingDataset, formatting and tokenizing each sample in ``__getitem__``."""

    def __init__(self, **kwargs: Any) -> None:
        from streaming import StreamingDataset
        from transformers import AutoTokenizer

        from pipelines.config import DataConfig, DatasetConfig
        from pipelines.sources.formats import make_formatter

        self.inner = StreamingDataset(**kwargs)
        self.tok = AutoTokenizer.from_pretrained(str(GPT2))
        ds = DatasetConfig(path="x", type="alpaca")
        self.fmt = make_formatter(ds, DataConfig(datasets=[ds]), self.tok)

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, idx: int) -> Any:
        sample = self.inner[idx]
        f = self.fmt({k: v for k, v in sample.items() if v is not None})
        return self.tok(f.text, add_special_tokens=True)["input_ids"] + [self.tok.eos_token_id]


def _ids_dataset(**kwargs: Any) -> Any:
    """llm-foundry's pre-tokenized case: a ``StreamingDataset`` subclass whose samples are the ``tokens``
    arrays, iterated with the base class's ``__iter__`` (its shard predownload and worker partitioning)."""
    from streaming import StreamingDataset

    class Ids(StreamingDataset):
        def __getitem__(self, idx: int) -> Any:
            return super().__getitem__(idx)["tokens"]

    return Ids(**kwargs)


def run_mosaic(p: dict[str, Any]) -> dict[str, Any]:
    import numpy as np
    from streaming.base.util import clean_stale_shared_memory
    from torch.utils.data import DataLoader

    sys.path.insert(0, str(ROOT))
    clean_stale_shared_memory()
    kwargs = {"local": p["local"], "shuffle": False, "batch_size": 64}
    if p.get("remote"):
        os.environ["S3_ENDPOINT_URL"] = p["endpoint"]
        kwargs["remote"] = p["remote"]
    if p.get("tokens"):  # already ids: a StreamingDataset subclass, as llm-foundry's (predownload, its defaults)
        ds: Any = _ids_dataset(**kwargs)
    else:
        ds = _TokenizingDataset(**kwargs)  # tokenizer loaded before the clock
    t = time.perf_counter()
    loader = DataLoader(ds, batch_size=64, num_workers=2, collate_fn=list, persistent_workers=False)
    rows = tokens = first_tokens = 0
    first = None
    buf: list[np.ndarray] = []
    n_buf = 0
    for batch in loader:  # concat-pack into SEQ_LEN rows in the main process
        if first is None:
            first, first_tokens = time.perf_counter() - t, sum(len(ids) for ids in batch)
        for ids in batch:
            buf.append(np.asarray(ids, dtype=np.int32))
            n_buf += len(ids)
        if n_buf >= SEQ_LEN:
            flat = np.concatenate(buf)
            k = len(flat) // SEQ_LEN * SEQ_LEN
            rows += k // SEQ_LEN
            tokens += k
            buf, n_buf = [flat[k:]], len(flat) - k
    if n_buf:
        rows, tokens = rows + 1, tokens + n_buf
    return {"init_s": 0.0, "ttfb_s": first, "total_s": time.perf_counter() - t, "rows": rows, "tokens": tokens,
            "first_tokens": first_tokens}


def run_litdata_tokens(p: dict[str, Any]) -> dict[str, Any]:
    """LitData's offline path read as its README's pre-training example reads it: ``StreamingDataset`` with
    ``TokensLoader(block_size=SEQ_LEN)`` (the example's 2048 + 1 adds the next-token target; SEQ_LEN gives the
    same rows as the other systems) and ``StreamingDataLoader(num_workers=2)``, 64 rows a batch, in order."""
    import litdata

    ds = litdata.StreamingDataset(input_dir=p["input_dir"], item_loader=litdata.TokensLoader(block_size=SEQ_LEN),
                                  shuffle=False, drop_last=False)
    t = time.perf_counter()
    loader = litdata.StreamingDataLoader(ds, batch_size=64, num_workers=2)
    rows = tokens = first_tokens = 0
    first = None
    for batch in loader:
        rows += batch.shape[0]
        tokens += batch.numel()
        if first is None:
            first, first_tokens = time.perf_counter() - t, tokens
    return {"init_s": 0.0, "ttfb_s": first, "total_s": time.perf_counter() - t, "rows": rows, "tokens": tokens,
            "first_tokens": first_tokens}


def run_convert(p: dict[str, Any]) -> dict[str, Any]:
    config = Path(p["out"]).with_name("convert-config.yaml")
    config.write_text(json.dumps({"model": {"tokenizer": str(GPT2)}, "data": {
        "datasets": [{"path": p["jsonl"], "format": "jsonl", "type": "alpaca"}], "sequence_len": SEQ_LEN}}))
    t = time.perf_counter()
    out = subprocess.run([sys.executable, str(ROOT / "ray_jobs" / "convert.py"), "--tokenize", "--config", str(config),
                          "--output", p["out"], "--write-tasks", "2", "--size-limit", str(p["shard_bytes"]),
                          "--hashes", "xxh64"], capture_output=True, text=True, env={**os.environ, "RAY_ADDRESS": ""})
    wall = time.perf_counter() - t
    if out.returncode:
        raise RuntimeError(out.stderr[-2000:])
    result = json.loads(next(line for line in out.stdout.splitlines() if line.startswith("{")))
    # convert.py's own "seconds" starts after ray.init: the conversion itself.
    return {"total_s": result["seconds"], "wall_s": wall, "rows": result["rows"], "shards": result["shards"]}


def _gpt2_tokenizer() -> Any:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(GPT2 / "tokenizer.json"))
    tok.no_truncation()
    return tok


def _write_tokenized(files: list[Path], out: str, shard_bytes: int, tok: Any) -> int:
    """Format, tokenize in batches of 1,000 (ids only) and write ``input_ids`` with mosaic's ``MDSWriter``."""
    import numpy as np
    from streaming import MDSWriter

    eos = tok.token_to_id("<|endoftext|>")
    rows = 0
    with MDSWriter(out=out, columns={"input_ids": "ndarray:int32"}, compression="zstd", hashes=["xxh64"],
                   size_limit=shard_bytes) as w:
        for path in files:
            with open(path, encoding="utf-8") as f:
                recs = [json.loads(line) for line in f]
            for b in range(0, len(recs), 1000):
                for enc in tok.encode_batch_fast(_alpaca_texts(recs[b : b + 1000])):  # ids only: no offsets
                    w.write({"input_ids": np.asarray(enc.ids + [eos], np.int32)})
                    rows += 1
    return rows


def run_tokenize_loop(p: dict[str, Any]) -> dict[str, Any]:
    """One process: format, tokenize in batches on the tokenizer's 2 Rust threads, MDSWriter."""
    sys.path.insert(0, str(ROOT))
    os.environ.update(TOKENIZERS_PARALLELISM="true", RAYON_NUM_THREADS="2")  # read by the Rust side at encode time
    import streaming  # noqa: F401  (a conversion script imports it first: before the clock)

    tok = _gpt2_tokenizer()  # before the clock
    _alpaca_texts([{"instruction": "warm up", "input": "", "output": "x"}])
    t = time.perf_counter()
    rows = _write_tokenized(sorted(Path(p["jsonl"]).glob("*.jsonl")), p["out"], p["shard_bytes"], tok)
    return {"total_s": time.perf_counter() - t, "rows": rows}


def _convert_group(args: tuple[list[str], str, int]) -> int:
    """One process of the ``mosaic_procs`` peer: its files into its own partition, one tokenizer thread."""
    files, out, shard_bytes = args
    sys.path.insert(0, str(ROOT))
    return _write_tokenized([Path(f) for f in files], out, shard_bytes, _gpt2_tokenizer())


def run_mosaic_procs(p: dict[str, Any]) -> dict[str, Any]:
    """mosaic's parallel conversion: a Pool of ``procs`` processes, one partition each, then ``merge_index``."""
    import multiprocessing

    import streaming  # noqa: F401  (imported by the script before the clock; the forked processes inherit it)

    sys.path.insert(0, str(ROOT))
    _alpaca_texts([{"instruction": "warm up", "input": "", "output": "x"}])  # the formatter's imports, likewise
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per process: ``procs`` processes on ``procs`` cores
    files = sorted(str(f) for f in Path(p["jsonl"]).glob("*.jsonl"))
    n = p.get("procs", 2)
    per = -(-len(files) // n)
    groups = [(files[k * per : (k + 1) * per], os.path.join(p["out"], str(k)), p["shard_bytes"]) for k in range(n)]
    t = time.perf_counter()
    with multiprocessing.Pool(n) as pool:  # as mosaic's example: the platform's default start (fork on Linux)
        rows = sum(pool.map(_convert_group, groups))
    from streaming.base.util import merge_index

    merge_index(p["out"], keep_local=True)
    total = time.perf_counter() - t
    if not Path(p["out"], "index.json").is_file():
        raise RuntimeError("merge_index wrote no index.json")
    return {"total_s": total, "rows": rows}


def run_convert_stages(p: dict[str, Any]) -> dict[str, Any]:
    """Ours' conversion stages in one process and one thread, without Ray: the read, the tokenizer stage (labels
    too) and our MDS writer over every file, as ``convert.py --tokenize`` runs them in its tasks and actors. Not a
    system a user runs: it separates the stages' cost from the cost of running them through Ray."""
    os.environ.update(TOKENIZERS_PARALLELISM="false", RAYON_NUM_THREADS="1")
    sys.path.insert(0, str(ROOT))
    import pyarrow as pa
    import pyarrow.compute as pc

    from pipelines.config import config_from_dict
    from pipelines.mds.writer import ShardWriter
    from pipelines.mds.writer import _arrow_rows as arrow_rows  # the samples MDSDatasink writes from a block
    from pipelines.sources.read import ReadOptions, read_files
    from pipelines.stats import StatsSink
    from pipelines.stream.spec import build_spec
    from pipelines.tokenize.stage import Tokenizer

    cfg = config_from_dict({"model": {"tokenizer": str(GPT2)}, "data": {
        "datasets": [{"path": p["jsonl"], "format": "jsonl", "type": "alpaca"}], "sequence_len": SEQ_LEN}})
    spec = build_spec(cfg, "train")
    table, sink = spec.table, StatsSink()
    opts = ReadOptions(storage=table.storage, on_bad_record="raise", unit_size=4096,
                       text_fields=tuple(d.text_field for d in table.datasets))
    tok = Tokenizer(spec.data, spec.model, table, sink, 1)  # the tokenizer loaded before the clock, as the peers'
    columns = {"input_ids": "ndarray:int32", "labels": "ndarray:int32", "source_sample_id": "int64"}
    t = time.perf_counter()
    rows = 0
    with ShardWriter(out=p["out"], columns=columns, compression="zstd", hashes=["xxh64"],
                     size_limit=p["shard_bytes"]) as w:
        for block in tok.stream(read_files(list(table.files), opts, sink)):
            block = block.filter(pc.greater(pc.list_value_length(block.column("input_ids")), 0))
            written = pa.table({"input_ids": block.column("input_ids"), "labels": block.column("labels"),
                                "source_sample_id": block.column("sample_id")})
            for sample in arrow_rows(written, columns):
                w.write(sample)
                rows += 1
    return {"total_s": time.perf_counter() - t, "rows": rows}


def steady_rate(r: dict[str, Any]) -> float:
    """Tokens/s after the first batch: start-up (worker processes, first shard) left out, reported beside
    the total (which the targets use)."""
    return (r["tokens"] - r["first_tokens"]) / max(r["total_s"] - r["ttfb_s"], 1e-9)


SYSTEMS = {"ours": run_ours, "ours_feeder": run_ours_feeder, "mosaic": run_mosaic, "litdata": run_litdata_tokens,
           "convert": run_convert, "tokenize_loop": run_tokenize_loop,
           "mosaic_procs": run_mosaic_procs, "convert_stages": run_convert_stages}


def interleaved(cases: dict[str, tuple[str, dict[str, Any]]], repeats: int) -> dict[str, dict[str, Any]]:
    """Run every case (key -> (system, params)) once per round, ``repeats`` rounds, each run in a fresh
    interpreter; per case, the run with the median total time, with every run's ``total_s`` (in round
    order) under ``runs_s``. Interleaving spreads a slow spell of the machine over all cases alike."""
    runs: dict[str, list[dict[str, Any]]] = {key: [] for key in cases}
    for _ in range(repeats):
        for key, (name, params) in cases.items():
            runs[key].append(_child_once(name, params))
    out = {}
    for key, rs in runs.items():
        ranked = sorted(rs, key=lambda r: r["total_s"])
        out[key] = {**ranked[len(ranked) // 2], "runs_s": [round(r["total_s"], 3) for r in rs], "repeats": repeats}
    return out


def _child_once(name: str, params: dict[str, Any]) -> dict[str, Any]:
    """One run of one system; its result is the line tagged ``TAG``. Outputs and mosaic's download
    cache are removed first, so every repeat starts cold."""
    stale = [params.get("out"), params.get("local") if params.get("remote") else None]  # never the source
    for path in filter(None, stale):
        shutil.rmtree(path, ignore_errors=True)
    if name == "mosaic" and not params.get("remote"):
        drop_decompressed(Path(params["local"]))
    python = sys.executable
    env = {**os.environ, **ENV}
    if name in ("mosaic", "tokenize_loop", "mosaic_procs"):  # mosaic's own code, in the venv that has it (tests/mosaic_venv.py)
        from benchlib import mosaic_python  # benchmarks/ is this script's directory

        python = str(mosaic_python())
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    out = subprocess.run([python, __file__, "--child", name, json.dumps(params)], capture_output=True,
                         text=True, env=env)
    for line in out.stdout.splitlines():
        if line.startswith(TAG):
            return json.loads(line[len(TAG):])
    raise RuntimeError(f"{name} failed:\n{out.stderr[-3000:]}")


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny data (~2 MB): check every measurement runs")
    ap.add_argument("--mb", type=float, default=50.0, help="uncompressed size of the data the reads use")
    ap.add_argument("--convert-mb", type=float, default=200.0, help="size of the JSONL the conversion case uses")
    ap.add_argument("--tok-mtokens", type=float, default=500.0,
                    help="M tokens of the local pre-tokenized sets (hard-linked copies of the S3 set; default 500)")
    ap.add_argument("--repeats", type=int, help="interleaved rounds, median reported (default 5, quick 1)")
    ap.add_argument("--cases", default="read,tok,convert", help="subset: read, tok (pre-tokenized reads), convert, stages (ours' conversion stages without Ray)")
    ap.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "pipelines-mds-bench"))
    ap.add_argument("--child", nargs=2, metavar=("NAME", "JSON"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(TAG + json.dumps(SYSTEMS[args.child[0]](json.loads(args.child[1]))), flush=True)
        return 0
    os.environ.update(ENV)
    mb, convert_mb, shard_bytes, files = (2.0, 2.0, 1 << 18, 4) if args.quick else (args.mb, args.convert_mb, 1 << 22, 16)
    reps = args.repeats or (1 if args.quick else 5)
    work = Path(args.work)
    groups = set(args.cases.split(","))
    unknown = groups - {"read", "tok", "convert", "stages"}
    if unknown:
        ap.error(f"--cases: unknown {sorted(unknown)} (read, tok, convert, stages)")
    data: dict[str, Any] = {}
    if groups & {"read", "tok"}:
        data.update(prepare(work, mb, shard_bytes, files))
        data.update(prepare_tokens(work, shard_bytes))
    if "tok" in groups:
        data.update(prepare_litdata_tokens(work))
        base = data["token_samples"] * SEQ_LEN
        copies = 1 if args.quick else max(1, -(-int(args.tok_mtokens * 1e6) // base))
        replicate_mds(work / "mds_tokens_raw", work / "mds_tokens_raw_big", copies)
        data.update(tok_copies=copies, tok_local_shards=replicate_mds(work / "mds_tokens", work / "mds_tokens_big",
                                                                      copies),
                    tok_local_chunks=replicate_litdata(work / "litdata_tokens", work / "litdata_tokens_big", copies))
        print(f"pre-tokenized: {base / 1e6:.1f} M tokens on S3, {copies} hard-linked copies locally "
              f"({copies * base / 1e6:.0f} M tokens, {data['tok_local_shards']} MDS shards, "
              f"{data['tok_local_chunks']} LitData chunks)", flush=True)
        print(f"data: {data['samples']} samples ({data['copies']} copies of Alpaca+LIMA), {data['raw_mb']:.1f} MB "
              f"uncompressed, {data['zstd_mb']:.1f} MB zstd in {data['shards']} shards; {files} JSONL files", flush=True)
    if groups & {"convert", "stages"}:
        data.update(prepare_convert(work, convert_mb, files))
        print(f"convert data: {data['convert_samples']} samples ({data['convert_copies']} copies), "
              f"{data['convert_mb']:.1f} MB of JSONL in {files} files", flush=True)
    moto, endpoint = start_moto() if groups & {"read", "tok"} else (None, "")
    try:
        cases: dict[str, tuple[str, dict[str, Any]]] = {}
        if "read" in groups:
            remote = upload(work / "mds", endpoint, f"{BUCKET}/mds")
            cases.update({
                "ours_local": ("ours", {"path": str(work / "mds")}),
                "mosaic_local": ("mosaic", {"local": str(work / "mds")}),
                "ours_s3": ("ours", {"path": remote, "endpoint": endpoint}),
                "mosaic_s3": ("mosaic", {"local": str(work / "cache-s3"), "remote": remote, "endpoint": endpoint})})
        if "tok" in groups:
            remote_tok = upload(work / "mds_tokens", endpoint, f"{BUCKET}/mds_tokens")
            cases.update({
                "ours_tok_local": ("ours_feeder", {"path": str(work / "mds_tokens_big")}),
                "ours_tok_local_inproc": ("ours_feeder", {"path": str(work / "mds_tokens_big"), "in_process": True}),
                "mosaic_tok_local": ("mosaic", {"local": str(work / "mds_tokens_big"), "tokens": True}),
                "ours_tok_local_raw": ("ours_feeder", {"path": str(work / "mds_tokens_raw_big")}),
                "litdata_tok_local": ("litdata", {"input_dir": str(work / "litdata_tokens_big")}),
                "ours_tok_s3": ("ours_feeder", {"path": remote_tok, "endpoint": endpoint}),
                "mosaic_tok_s3": ("mosaic", {"local": str(work / "cache-tok-s3"), "remote": remote_tok,
                                             "endpoint": endpoint, "tokens": True})})
        if "convert" in groups:
            jsonl = str(work / "jsonl_convert")
            cases.update({
                "convert": ("convert", {"jsonl": jsonl, "out": str(work / "converted"), "shard_bytes": shard_bytes}),
                "mosaic_procs": ("mosaic_procs", {"jsonl": jsonl, "out": str(work / "mosaic_procs"),
                                                  "shard_bytes": shard_bytes, "procs": 2}),
                "tokenize_loop": ("tokenize_loop", {"jsonl": jsonl, "out": str(work / "tokenize_loop"),
                                                    "shard_bytes": shard_bytes})})
        if "stages" in groups:
            cases["convert_stages"] = ("convert_stages", {"jsonl": str(work / "jsonl_convert"),
                                                          "out": str(work / "convert_stages"),
                                                          "shard_bytes": shard_bytes})
        results = interleaved(cases, reps)
    finally:
        if moto is not None:
            moto.terminate()
            moto.wait(10)
    labels = {"ours_local": "build_dataset, local MDS", "mosaic_local": "mosaic StreamingDataset+DataLoader(2), local",
              "ours_s3": "build_dataset, MDS on S3 (moto)", "mosaic_s3": "mosaic StreamingDataset+DataLoader(2), S3 (moto)",
              "ours_tok_local": "the feeder (training's path), pre-tokenized MDS, local",
              "ours_tok_local_inproc": "the feeder's code in the consumer's process (no actor), pre-tokenized, local",
              "mosaic_tok_local": "mosaic StreamingDataset subclass+DataLoader(2), pre-tokenized, local",
              "ours_tok_local_raw": "the feeder (training's path), pre-tokenized MDS without compression, local",
              "litdata_tok_local": "LitData StreamingDataset(TokensLoader)+StreamingDataLoader(2), optimized, local",
              "ours_tok_s3": "the feeder (training's path), pre-tokenized MDS on S3 (moto)",
              "mosaic_tok_s3": "mosaic StreamingDataset subclass+DataLoader(2), pre-tokenized, S3 (moto)",
              "convert": "ray_jobs/convert.py --tokenize JSONL -> MDS (2 tasks)",
              "mosaic_procs": "mosaic parallel conversion: Pool(2) x MDSWriter + merge_index",
              "tokenize_loop": "one process: tokenize (2 threads) + MDSWriter loop",
              "convert_stages": "ours' stages in one process, one thread, no Ray (not a peer)"}
    print(f"\nmedian of {reps} interleaved run(s) per system, each in a fresh process; spread: min-max of total s")
    print("\n| system | total s | spread s | first batch s | start-up s | rows | tokens | Mtok/s "
          "| Mtok/s after the first batch | runs in round order (total s) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for name, r in results.items():
        startup = r.get("init_s", r.get("wall_s", r["total_s"]) - r["total_s"])
        tokens = r.get("tokens")
        spread = f"{min(r['runs_s']):.2f}-{max(r['runs_s']):.2f}"
        print(f"| {labels[name]} | {r['total_s']:.2f} | {spread} | " + (f"{r['ttfb_s']:.2f}" if r.get("ttfb_s") else "")
              + f" | {startup:.2f} | {r['rows']} | {tokens or ''} | " +
              (f"{tokens / r['total_s'] / 1e6:.3f}" if tokens else "") + " | " +
              (f"{steady_rate(r) / 1e6:.3f}" if tokens else "") + f" | {r['runs_s']} |")
    summary: dict[str, Any] = {"data": data, "repeats": reps}
    for where in [w for w in ("local", "s3", "tok_local", "tok_s3") if f"ours_{w}" in results]:
        a, b = results[f"ours_{where}"], results[f"mosaic_{where}"]
        ratio = (a["tokens"] / a["total_s"]) / (b["tokens"] / b["total_s"])
        same = a["tokens"] == b["tokens"]
        steady = steady_rate(a) / steady_rate(b)
        summary[f"read_{where}_ratio"] = round(ratio, 3)
        summary[f"read_{where}_steady_ratio"] = round(steady, 3)
        print(f"read {where:<9}: ours / mosaic loader = {ratio:.2f}x tokens/s, {steady:.2f}x after each "
              f"one's first batch ({'same' if same else 'DIFFERENT'} token count: {a['tokens']} vs {b['tokens']})")
    def ratios(key: str, a: dict[str, Any], b: dict[str, Any]) -> str:
        """``a`` against ``b`` over the pass and after each one's first batch, kept in the summary under ``key``."""
        summary[f"{key}_ratio"] = round((a["tokens"] / a["total_s"]) / (b["tokens"] / b["total_s"]), 3)
        summary[f"{key}_steady_ratio"] = round(steady_rate(a) / steady_rate(b), 3)
        return (f"{summary[f'{key}_ratio']:.2f}x tokens/s, {summary[f'{key}_steady_ratio']:.2f}x after each one's "
                "first batch")

    if "litdata_tok_local" in results:  # LitData's own offline format: the same token stream, its chunking
        a, b = results["ours_tok_local_raw"], results["litdata_tok_local"]
        print(f"read tok_local, both uncompressed: ours / LitData's loader = {ratios('read_tok_local_vs_litdata', a, b)} "
              f"({a['tokens']} vs {b['tokens']} tokens: LitData drops each chunk's last partial row)")
    if "ours_tok_local_inproc" in results:  # the same code without the actor, against the same peer run
        print("read tok_local, the feeder's code in the consumer's process / mosaic loader = "
              + ratios("read_tok_local_inproc", results["ours_tok_local_inproc"], results["mosaic_tok_local"]))
    if "convert" in results:
        peers = {k: results[k] for k in ("mosaic_procs", "tokenize_loop")}
        best = min(peers, key=lambda k: peers[k]["total_s"])
        rows = {k: results[k]["rows"] for k in ("convert", *peers)}
        if len(set(rows.values())) != 1:
            raise RuntimeError(f"the conversions wrote different row counts: {rows}")
        conv = peers[best]["total_s"] / results["convert"]["total_s"]
        conv_wall = peers[best]["total_s"] / results["convert"]["wall_s"]
        summary.update(convert_ratio=round(conv, 3), convert_ratio_with_startup=round(conv_wall, 3), convert_peer=best,
                       convert_vs={k: round(v["total_s"] / results["convert"]["total_s"], 3) for k, v in peers.items()})
        print(f"convert: convert.py --tokenize / the best peer ({labels[best]}) = {conv:.2f}x rows/s "
              f"({conv_wall:.2f}x counting Ray start-up); vs each peer: {summary['convert_vs']}")
    summary["headline"] = headline_rows(results, labels)
    print("RESULT " + json.dumps(summary))
    return 0


HEADLINES = {"local": "B6 raw-text MDS read, local", "s3": "B6 raw-text MDS read, loopback S3",
             "tok_local": "B6 pre-tokenized MDS read, local", "tok_s3": "B6 pre-tokenized MDS read, loopback S3"}


def headline_rows(results: dict[str, dict[str, Any]], labels: dict[str, str]) -> list[dict[str, Any]]:
    """This run's rows of BENCHMARKS.md's opening table (``benchlib.headline``): each read against mosaic's
    loader, and the conversion against the faster of its two peers."""
    from benchlib import figures, headline

    def fig(key: str, rate: bool = True) -> dict[str, Any]:
        r = results[key]
        return figures(labels[key], r["total_s"], r.get("ttfb_s"), steady_rate(r) / 1e6 if rate else None,
                       r.get("runs_s"))

    rows = [headline(title, "M tok/s", fig(f"ours_{w}"), fig(f"mosaic_{w}"))
            for w, title in HEADLINES.items() if f"ours_{w}" in results and f"mosaic_{w}" in results]
    if "ours_tok_local_raw" in results and "litdata_tok_local" in results:  # each in its uncompressed format
        rows.append(headline("B6 pre-tokenized read, local, uncompressed (MDS / LitData chunks)", "M tok/s",
                             fig("ours_tok_local_raw"), fig("litdata_tok_local")))
    peers = [k for k in ("mosaic_procs", "tokenize_loop") if k in results]
    if "convert" in results and peers:
        best = min(peers, key=lambda k: results[k]["total_s"])
        rows.append(headline("B6 convert.py --tokenize, JSONL -> tokenized MDS", "-", fig("convert", rate=False),
                             fig(best, rate=False)))
    return rows


if __name__ == "__main__":
    sys.exit(main())
