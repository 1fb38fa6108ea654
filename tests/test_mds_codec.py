"""Our MDS shard writer/reader vs mosaic's own: byte-identical shards, identical samples, no torch import."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

COLUMNS = {"text": "str", "tokens": "ndarray:int32", "n": "int64", "meta": "json"}


def _rows(k: int = 300) -> list[dict]:
    return [{"text": "héllo " * i, "tokens": np.arange(i + 1, dtype=np.int32) * 7, "n": i, "meta": {"i": [i]}}
            for i in range(k)]


@pytest.mark.parametrize("compression", ["zstd", None, "bz2:5"])  # not gz: it stamps the time
def test_part_writer_bytes_equal_mdswriter(tmp_path, compression):
    from streaming import MDSWriter

    from pipelines.mds.writer import _PartWriter

    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    w = _PartWriter(out=str(ours), columns=COLUMNS, compression=compression, hashes=["sha1", "xxh64"], size_limit="4kb")
    for r in _rows():
        w.write(r)
    w.finish()
    with MDSWriter(out=str(theirs), columns=COLUMNS, compression=compression, hashes=["sha1", "xxh64"],
                   size_limit=1 << 12) as m:
        for r in _rows():
            m.write(r)
    names = sorted(p.name for p in theirs.iterdir())
    assert len(names) > 20 and sorted(p.name for p in ours.iterdir()) == names
    for name in names:
        assert (ours / name).read_bytes() == (theirs / name).read_bytes(), name


def test_memory_shard_decodes_as_mosaic(tmp_path):
    from streaming import MDSWriter, StreamingDataset

    from pipelines.mds import codec as mosaic
    from pipelines.mds.reader import MemoryShard

    with MDSWriter(out=str(tmp_path), columns=COLUMNS, compression="zstd", size_limit=1 << 12) as m:
        for r in _rows():
            m.write(r)
    sd = StreamingDataset(local=str(tmp_path), shuffle=False, batch_size=1)
    index = json.loads((tmp_path / "index.json").read_text())
    k = 0
    for shard in index["shards"]:
        raw = mosaic.compression.decompress("zstd", (tmp_path / shard["zip_data"]["basename"]).read_bytes())
        ms = MemoryShard.from_bytes(shard, raw, "test")
        for i in range(shard["samples"]):
            mine, want = ms.get_item(i), sd[k]
            assert mine.keys() == want.keys() and mine["text"] == want["text"] and mine["meta"] == want["meta"]
            assert np.array_equal(mine["tokens"], want["tokens"]) and mine["n"] == want["n"]
            k += 1
    assert k == 300


def test_mds_modules_do_not_import_torch():
    """Read and write workers import the MDS modules; mosaic's package init would pull torch (seconds)."""
    code = ("import sys, pipelines.mds.reader, pipelines.mds.writer, pipelines.mds.index\n"
            "print(sorted(m for m in ('torch', 'transformers', 'streaming') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_token_arrays_travel_compactly_and_exactly():
    """Token arrays of MDS samples cross the read -> tokenizer boundary as base64 of their bytes."""
    from pipelines.sources.records import pack_array, unpack_array

    rng = np.random.default_rng(0)
    for dtype in (np.int32, np.int64, np.uint16, np.dtype(">i4")):
        a = rng.integers(0, 50_000, 777).astype(dtype)
        packed = json.loads(json.dumps({"input_ids": pack_array(a)}))["input_ids"]
        assert set(packed) == {"dtype", "b64"} and len(packed["b64"]) < 4 * a.nbytes // 3 + 8
        out = unpack_array(packed)
        assert out.dtype == np.int64 and np.array_equal(out, a.astype(np.int64))
    assert unpack_array([1, 2, 3]).tolist() == [1, 2, 3]  # plain JSON lists (JSONL input_ids) still work
    with pytest.raises(ValueError):
        unpack_array({"dtype": "float32", "b64": ""})
