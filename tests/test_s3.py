"""Object storage for real: a moto S3 server on loopback (bytes over HTTP, nothing mocked).

Proves: the same data as JSONL on S3, as MDS on S3 and as MDS on local disk gives identical packed
rows; our datasink writes to S3 what mosaic's StreamingDataset (boto3) reads back exactly; convert.py
reads JSONL from S3 and writes MDS to S3; a missing bucket, bad credentials, a refusing endpoint and
a missing shard fail with clear, credential-free messages (fast where retrying cannot help, after the
stated number of retries where it can); and a read through 503s, cut-off responses and a server
outage finishes with every sample exactly once.
"""

from __future__ import annotations

import json
import logging
import re
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from conftest import ALPACA, load_ray_job, make_config, needs_shared
from conftest_s3 import FAKE_SECRET, FaultProxy, MotoServer, free_port
from mds_sets import mds_write, plain_sample
from mosaic_venv import mosaic_read

from pipelines.config import StorageConfig
from pipelines.mds.index import MDSError
from pipelines.mds.writer import MDSDatasink
from pipelines.sources.listing import SourceError, resolve_sources, split_sample_id
from pipelines.storage import StorageError, StorageOptions
from pipelines.stream.dataset import build_dataset
from pipelines.stream.stages import iter_packed_local

pytestmark = needs_shared

BUCKET = "pipelines-s3-tests"
ROW_KEYS = ("input_ids", "labels", "position_ids", "sample_ids")


@pytest.fixture(scope="module")
def corpus(moto_s3, tmp_path_factory) -> dict:
    """ALPACA as MDS (zstd, dozens of shards, as mosaic's MDSWriter writes them) locally and on S3, and as one
    JSONL file per shard on S3 (same names in the same order, so sample ids match file for file)."""
    records = json.loads(ALPACA.read_text())
    local = tmp_path_factory.mktemp("s3corpus")
    mds = mds_write(local / "mds", records, {"instruction": "str", "input": "str", "output": "str"}, "zstd")
    shards = json.loads((mds / "index.json").read_text())["shards"]
    jsonl = local / "jsonl"
    jsonl.mkdir()
    start = 0
    for k, shard in enumerate(shards):
        part = records[start : start + shard["samples"]]
        (jsonl / f"shard.{k:05d}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
        start += shard["samples"]
    assert start == len(records) and len(shards) >= 20
    moto_s3.make_bucket(BUCKET)
    return {
        "records": records,
        "shards": len(shards),
        "mds_local": str(mds),
        "mds_s3": moto_s3.upload_dir(mds, f"{BUCKET}/alpaca-mds"),
        "jsonl_s3": moto_s3.upload_dir(jsonl, f"{BUCKET}/alpaca-jsonl"),
    }


def _cfg(path: str, endpoint: str | None, retries: int = 2, **data):
    cfg = make_config([{"path": path, "type": "alpaca"}], sequence_len=2048, read_tasks=2, **data)
    cfg.storage = StorageConfig(endpoint_url=endpoint, retries=retries)
    return cfg


def _rows(cfg) -> list[tuple]:
    return [tuple(tuple(r[k]) for k in ROW_KEYS) for r in build_dataset(cfg).take_all()]


def _assert_every_sample_once(rows: list[tuple], n_files: int, n_samples: int) -> None:
    ids = [s for r in rows for s in r[3]]
    assert len(ids) == len(set(ids)) == n_samples
    assert {split_sample_id(s)[0] for s in ids} == set(range(n_files))


@pytest.fixture(scope="module")
def reference_rows(ray_local, corpus, moto_s3) -> list[tuple]:
    return _rows(_cfg(corpus["mds_local"], None))


def test_jsonl_on_s3_mds_on_s3_and_mds_local_give_identical_rows(ray_local, corpus, moto_s3, reference_rows):
    from_mds_s3 = _rows(_cfg(corpus["mds_s3"], moto_s3.endpoint))
    from_jsonl_s3 = _rows(_cfg(corpus["jsonl_s3"], moto_s3.endpoint))
    _assert_every_sample_once(reference_rows, corpus["shards"], len(corpus["records"]))
    assert len(reference_rows) > 50
    assert from_mds_s3 == reference_rows  # same order too (data.deterministic)
    assert from_jsonl_s3 == reference_rows  # one JSONL file per shard: the same units, ids and order


@pytest.mark.slow  # runs mosaic's own reader in its venv (tests/mosaic_venv.py)
def test_datasink_to_s3_read_by_mosaic_streaming_dataset(ray_local, moto_s3, corpus, tmp_path, monkeypatch,
                                                         mosaic_python):
    rows = [{"idx": i, "text": r["output"], "ids": list(range(i % 9 + 1))} for i, r in enumerate(corpus["records"])]
    schema = pa.schema([("idx", pa.int64()), ("text", pa.string()), ("ids", pa.list_(pa.int32()))])
    ds = ray_local.data.from_arrow(pa.Table.from_pylist(rows, schema=schema)).repartition(2)
    url = f"s3://{BUCKET}/sink-out"
    sink = MDSDatasink(url, hashes=["xxh64"], size_limit=1 << 15, storage=StorageOptions(endpoint_url=moto_s3.endpoint))
    ds.write_datasink(sink)
    assert sink.written["rows"] == len(rows) and sink.written["parts"] == 2 and sink.written["shards"] > 10

    monkeypatch.setenv("S3_ENDPOINT_URL", moto_s3.endpoint)  # mosaic's boto3 client
    (got,) = mosaic_read(mosaic_python, [url], validate_hash="xxh64").values()
    want = [plain_sample({"idx": np.int64(r["idx"]), "text": r["text"], "ids": np.array(r["ids"], np.int32)})
            for r in rows]
    assert sorted(got, key=lambda g: g["idx"][2]) == want
    # Writing again to the same place is refused rather than mixing two datasets.
    with pytest.raises(MDSError, match="already holds an MDS dataset"):
        sink.on_write_start()


@pytest.mark.slow  # runs mosaic's own reader in its venv (tests/mosaic_venv.py)
def test_convert_jsonl_on_s3_to_mds_on_s3(ray_local, moto_s3, corpus, tmp_path, monkeypatch, capsys, mosaic_python):
    out = f"s3://{BUCKET}/converted"
    code = load_ray_job("convert").main(["--input", corpus["jsonl_s3"], "--output", out, "--endpoint-url",
                                   moto_s3.endpoint, "--size-limit", "64kb", "--write-tasks", "2"])
    assert code == 0, capsys.readouterr().err
    monkeypatch.setenv("S3_ENDPOINT_URL", moto_s3.endpoint)
    (got,) = mosaic_read(mosaic_python, [out]).values()
    assert got == [plain_sample(r) for r in corpus["records"]]  # same records, in file order


# ----------------------------------------------------------------------------- bad input


def test_bucket_that_does_not_exist(moto_s3):
    t = time.monotonic()
    with pytest.raises(SourceError, match="bucket 'no-such-bucket-here' does not exist"):
        resolve_sources(_cfg("s3://no-such-bucket-here/data/", moto_s3.endpoint, retries=5))
    assert time.monotonic() - t < 5  # not retried


def test_bad_credentials_fail_fast_without_leaking_them(moto_s3, caplog):
    # moto_s3 puts the (fake) credentials in the environment; this second server rejects them.
    server = MotoServer(env={"INITIAL_NO_AUTH_ACTION_COUNT": "0"})  # this server checks credentials
    try:
        caplog.set_level(logging.DEBUG)
        t = time.monotonic()
        with pytest.raises(StorageError) as err:
            resolve_sources(_cfg(f"s3://{BUCKET}/alpaca-mds", server.endpoint, retries=5))
        assert time.monotonic() - t < 5  # not retried
    finally:
        server.stop()
    msg = str(err.value)
    assert "access denied" in msg and "check the credentials" in msg and f"s3://{BUCKET}/alpaca-mds" in msg
    assert FAKE_SECRET not in msg and FAKE_SECRET not in caplog.text


def test_endpoint_refusing_connections_fails_after_the_retries(moto_s3, caplog):
    port = free_port()  # nothing listens here
    caplog.set_level(logging.WARNING, logger="pipelines.storage")
    with pytest.raises(StorageError) as err:
        resolve_sources(_cfg(f"s3://{BUCKET}/alpaca-mds", f"http://127.0.0.1:{port}", retries=2))
    msg = str(err.value)
    assert "failed after 2 retries" in msg and f"could not connect to http://127.0.0.1:{port}" in msg
    assert caplog.text.count("transient error, retry") == 2 and FAKE_SECRET not in caplog.text + msg


def test_shard_missing_on_s3_names_dataset_and_shard(moto_s3, corpus, caplog):
    url = moto_s3.upload_dir(Path(corpus["mds_local"]), f"{BUCKET}/one-shard-gone")
    index = json.loads((Path(corpus["mds_local"]) / "index.json").read_text())
    gone = index["shards"][3]["zip_data"]["basename"]
    moto_s3.fs().delete_file(f"{BUCKET}/one-shard-gone/{gone}")
    with pytest.raises(Exception, match=re.escape(f"MDS dataset {url}: shard {gone}: listed in index.json but missing")):
        list(iter_packed_local(_cfg(url, moto_s3.endpoint, retries=5)))
    assert "transient error, retry" not in caplog.text  # a missing key is final: not retried


# ----------------------------------------------------------------------------- faults


@pytest.mark.slow  # end to end through Ray Data on real data: the full suite runs it, the fast tier does not
def test_503s_cut_responses_and_an_outage_mid_read_lose_nothing(ray_local, moto_s3, corpus, reference_rows):
    proxy = FaultProxy(moto_s3.port)
    try:
        rows = _rows(_cfg(corpus["mds_s3"], proxy.endpoint, retries=5))
    finally:
        proxy.close()
    # Every kind of fault really happened, and reads went on after the outage.
    assert proxy.injected == {"slow_down": 4, "cut": 4, "outage": 1}, proxy.injected
    assert proxy.gets_after_outage >= 5
    _assert_every_sample_once(rows, corpus["shards"], len(corpus["records"]))
    assert rows == reference_rows
