"""Our MDS reader and writer against mosaic-streaming's, both ways, without mosaic in this environment.

Proves:
* every sample of every committed set that mosaic's own ``MDSWriter`` wrote (tests/fixtures/mds/mosaic:
  every encoding we support; no compression, zstd, zstd:7, gz, bz2:5, snappy, br:4; sha1, md5, sha256,
  xxh64, xxh3_64, xxh128; a nested index from ``merge_index``) decodes here to the value written, with
  its exact type, dtype and shape;
* our writer, given the same samples and settings, writes the same bytes as mosaic did (every file,
  index.json included; gz stamps the time, so its shards are compared decompressed);
* mosaic's own ``StreamingDataset``, in a venv of its own (tests/mosaic_venv.py), reads every sample our
  writer wrote back as written, checking a hash of every shard;
* bad sets fail with an error that names the dataset, the shard and, where it is one sample, the sample.
"""

from __future__ import annotations

import gzip
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.fs as pafs
import pytest
from mds_sets import FIXTURES, mds_write, merge_index, plain_sample, read_ours, shard_files
from mosaic_venv import mosaic_read
from samples import COLUMNS, NESTED, SETS, samples

from pipelines.mds import encodings
from pipelines.mds.compression import compress, decompress, get_hash
from pipelines.mds.index import MDSError
from pipelines.mds.reader import read_mds
from pipelines.mds.writer import nested_index

MOSAIC = FIXTURES / "mosaic"
ALL_SETS = [*SETS, "nested"]


def write_ours(out: Path, compression, hashes, size_limit, rows) -> Path:
    return mds_write(out, rows, COLUMNS, compression, hashes, size_limit)


@pytest.mark.parametrize("name", ALL_SETS)
def test_every_sample_mosaic_wrote_decodes_as_written(name):
    got = [plain_sample(s) for s in read_ours(MOSAIC / name)]
    want = [plain_sample(s) for s in samples()]
    assert len(got) == len(want) == 40
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g == w, (name, i, {k: (g[k], w[k]) for k in w if g.get(k) != w[k]})
    index = json.loads((MOSAIC / name / "index.json").read_text())
    assert len(index["shards"]) >= 4  # several shards, so the offsets and the order of shards count


def test_the_plain_form_tells_types_apart():
    """The comparison above would catch a decoder that returns the right numbers in the wrong type."""
    s = samples()[3]
    assert plain_sample(s)["u8"] != plain_sample({**s, "u8": int(s["u8"])})["u8"]
    assert plain_sample(s)["arr"] != plain_sample({**s, "arr": s["arr"].astype(np.int64)})["arr"]
    assert plain_sample(s)["arr"] != plain_sample({**s, "arr": s["arr"].ravel()})["arr"]


@pytest.mark.parametrize("name", list(SETS))
def test_our_writer_writes_the_bytes_mosaic_wrote(tmp_path, name):
    compression, hashes, size_limit = SETS[name]
    ours = write_ours(tmp_path / name, compression, hashes, size_limit, samples())
    theirs = MOSAIC / name
    names = sorted(p.name for p in theirs.iterdir())
    assert sorted(p.name for p in ours.iterdir()) == names
    for f in names:
        a, b = (ours / f).read_bytes(), (theirs / f).read_bytes()
        if name == "gz" and f != "index.json":  # gzip's header holds the time of writing
            a, b = gzip.decompress(a), gzip.decompress(b)
        elif name == "gz":  # ... and so the zip_data hashes in the index differ
            a, b = (json.loads(x) for x in (a, b))
            for s in (*a["shards"], *b["shards"]):
                s["zip_data"]["hashes"] = {}
        assert a == b, f"{name}/{f}"


def test_encodings_of_one_value_match_the_documented_layout():
    """The worked example of pipelines/mds/encodings.py, byte for byte, and its round trip."""
    value = np.array([[1, 2, 3]], np.int32)
    data = encodings.encode("ndarray", value)
    assert data.hex() == "21" + "08" + "0103" + "010000000200000003000000"
    back = encodings.decode("ndarray", data)
    assert back.dtype == np.int32 and back.shape == (1, 3) and back.tolist() == [[1, 2, 3]]
    assert encodings.encoded_size("ndarray:uint16:2,3") == 12 and encodings.encoded_size("ndarray:int32") is None
    assert encodings.encode("ndarray:int32", np.arange(300, dtype=np.int32))[:3].hex() == "052c01"  # 1 dim << 2 | 1 (uint16), then 300


@pytest.mark.parametrize(("encoding", "value", "message"), [
    ("ndarray:int32", np.arange(3, dtype=np.int64), "wrong dtype"),
    ("ndarray:uint16:2,3", np.zeros((3, 2), np.uint16), "wrong shape"),
    ("ndarray", np.zeros(0, np.int32), "empty"),
    ("ndarray", np.array(["a"]), "arrays of dtype str32 cannot be stored"),
    ("str", 3, "'str' takes text"),
    ("str_int", 1.5, "takes int"),
])
def test_values_that_do_not_fit_their_encoding_say_why(encoding, value, message):
    with pytest.raises(ValueError, match=message):
        encodings.encode(encoding, value)


@pytest.mark.parametrize(("encoding", "message"), [
    ("pkl", "unsafe encoding 'pkl'"), ("jpeg", "image encoding"), ("ndarray:complex64", "dtype 'complex64'"),
    ("ndarray:int32:2,x", "comma-separated"), ("tensor", "unknown MDS encoding 'tensor'"),
])
def test_encodings_we_do_not_read_are_named(encoding, message):
    assert message in encodings.encoding_problem(encoding)
    for ok in COLUMNS.values():
        assert encodings.encoding_problem(ok) is None


def test_compressions_and_hashes_round_trip_and_match_known_digests():
    data = b"MDS shard bytes " * 100
    for algo in ("zstd", "zstd:7", "gz", "bz2:5", "snappy", "br", "br:4"):
        assert decompress(algo, compress(algo, data)) == data and compress(algo, data) != data
    assert get_hash("xxh64", b"") == "ef46db3751d8e999" and get_hash("md5", b"") == "d41d8cd98f00b204e9800998ecf8427e"
    with pytest.raises(ValueError, match="levels 1-22"):
        compress("zstd:30", data)


# ----------------------------------------------------------------------------- bad sets


def _copy(tmp_path: Path, name: str = "zstd") -> Path:
    return Path(shutil.copytree(MOSAIC / name, tmp_path / name))


def _read_all(root: Path) -> list:
    bad = []
    rows = [r for f in shard_files(root) for r in read_mds(pafs.LocalFileSystem(), f, lambda w, why: bad.append((w, why)))]
    return rows, bad


def test_a_wrong_hash_names_the_shard(tmp_path):
    root = _copy(tmp_path)
    path = root / "shard.00002.mds.zstd"
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(MDSError, match=rf"MDS dataset {root}: shard shard.00002.mds.zstd: xxh3_64 hash mismatch"):
        _read_all(root)


def test_a_truncated_shard_names_the_shard(tmp_path):
    root = _copy(tmp_path, "plain")
    path = root / "shard.00001.mds"
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(MDSError, match=r"shard shard.00001.mds: the file is \d+ bytes but index.json says"):
        _read_all(root)


def test_an_index_naming_a_missing_shard_names_it(tmp_path):
    root = _copy(tmp_path, "nested")
    (root / "b" / "shard.00001.mds").unlink()
    with pytest.raises(MDSError, match=r"shard b/shard.00001.mds: listed in index.json but missing"):
        _read_all(root)


def test_unknown_and_unsafe_encodings_are_refused_when_listing(tmp_path):
    with pytest.raises(MDSError, match=r"shard 0 \(shard.00000.mds\): column 'obj' uses the unsafe encoding 'pkl'"):
        shard_files(MOSAIC / "pkl")
    root = _copy(tmp_path, "plain")
    index = json.loads((root / "index.json").read_text())
    index["shards"][1]["column_encodings"][0] = "tensor"
    (root / "index.json").write_text(json.dumps(index))
    with pytest.raises(MDSError, match=r"shard 1 \(shard.00001.mds\): column 'arr' has unknown MDS encoding 'tensor'"):
        shard_files(root)


def test_a_sample_that_does_not_decode_is_reported_with_its_row(tmp_path):
    """A shard whose hashes match but one sample's array bytes are cut short: that sample, by row, and
    every other sample read."""
    root = tmp_path / "one"
    rows = samples(range(6))
    write_ours(root, None, [], None, rows)
    path = root / "shard.00000.mds"
    raw = bytearray(path.read_bytes())
    n = int(np.frombuffer(raw, np.uint32, count=1)[0])
    offsets = np.frombuffer(raw, np.uint32, count=n + 1, offset=4)
    # The sample layout: the sizes of the variable columns first; 'arr' is the first column (sorted names).
    start = int(offsets[4])
    arr_size = int(np.frombuffer(raw, np.uint32, count=1, offset=start)[0])
    raw[start : start + 4] = np.uint32(arr_size - 1).tobytes()  # one byte short; 'blob' takes it
    raw[start + 4 : start + 8] = (int(np.frombuffer(raw, np.uint32, count=1, offset=start + 4)[0]) + 1).to_bytes(4, "little")
    path.write_bytes(bytes(raw))
    index = json.loads((root / "index.json").read_text())
    got, bad = _read_all(root)
    assert [r[0] for r in got] == [0, 1, 2, 3, 5] and len(index["shards"]) == 1
    ((where, why),) = bad
    assert where == f"MDS dataset {root}: shard shard.00000.mds row 4" and "ndarray" in why


# ----------------------------------------------------------------------------- mosaic reads ours


@pytest.mark.slow
def test_mosaic_streaming_dataset_reads_every_sample_we_wrote(tmp_path, mosaic_python):
    dirs = {}
    for name, (compression, hashes, size_limit) in SETS.items():
        dirs[name] = write_ours(tmp_path / name, compression, hashes, size_limit, samples())
    for sub, (compression, hashes, size_limit, rows) in NESTED.items():
        write_ours(tmp_path / "nested" / sub, compression, hashes, size_limit, samples(rows))
    merge_index(tmp_path / "nested")
    dirs["nested"] = tmp_path / "nested"
    want = [plain_sample(s) for s in samples()]
    for algo in ("xxh64", None):  # xxh64 checked on the sets that list it; then every set
        chosen = {k: d for k, d in dirs.items() if algo is None or algo in SETS.get(k, (None, []))[1]}
        read = mosaic_read(mosaic_python, [str(d) for d in chosen.values()], validate_hash=algo)
        for name, d in chosen.items():
            assert read[str(d)] == want, name
        assert algo is None or set(chosen) == {"plain", "bz2", "snappy"}


def test_our_nested_index_is_the_one_merge_index_wrote():
    root = MOSAIC / "nested"
    parts = [(sub, json.loads((root / sub / "index.json").read_text())["shards"]) for sub in NESTED]
    assert nested_index(parts) == json.loads((root / "index.json").read_text())


# ----------------------------------------------------------------------------- imports and token arrays


def test_mds_modules_do_not_import_torch():
    """Read and write workers import the MDS modules: no torch or transformers (seconds each), and the
    compressors only when a shard uses them."""
    code = ("import sys, pipelines.mds.reader, pipelines.mds.writer, pipelines.mds.index\n"
            "print(sorted(m for m in ('torch', 'transformers', 'streaming', 'zstd', 'snappy') if m in sys.modules))")
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


def _one_shard(root: Path):
    """The only shard of an uncompressed set at ``root``, in memory."""
    from pipelines.mds.reader import MemoryShard

    (info,) = json.loads((root / "index.json").read_text())["shards"]
    return MemoryShard.from_bytes(info, (root / info["raw_data"]["basename"]).read_bytes(), "test shard")


def test_a_token_shard_decodes_at_once_to_what_each_sample_decodes_to(tmp_path):
    """A shard of one token column (llm-foundry's ``tokens: ndarray:int32``) is decoded with a few numpy operations
    (``MemoryShard.token_views``, what the pre-tokenized reader uses) to exactly the arrays ``get_item`` decodes one
    by one: every integer dtype, dimensions stored in one, two and four bytes, and fixed shapes. Any other shard,
    or one with a malformed sample, is left to ``get_item``, which names the sample."""
    rng = np.random.default_rng(0)
    lengths = [1, 7, 255, 256, 300, 70_000, 3]  # 70,000 needs a four-byte dimension; 256 and 300 two bytes
    for enc, dt in {"ndarray:int32": np.int32, "ndarray:int64": np.int64, "ndarray:uint16": np.uint16,
                    "ndarray:uint8": np.uint8, "ndarray:int32:5": np.int32}.items():
        sizes = [5] * 4 if enc.endswith(":5") else lengths
        want = [rng.integers(0, 250, n).astype(dt) for n in sizes]
        shard = _one_shard(mds_write(tmp_path / enc.replace(":", "_"), [{"tokens": a} for a in want], {"tokens": enc},
                                     size_limit=None))
        name, views = shard.token_views()
        assert name == "tokens" and len(views) == len(want), enc
        for i, (got, one) in enumerate(zip(views, want, strict=True)):
            by_one = shard.get_item(i)["tokens"]
            assert got.dtype == by_one.dtype == dt and got.tolist() == by_one.tolist() == one.tolist(), (enc, i)

    # Shards the one-pass decode leaves alone: another column beside the ids, no dtype in the encoding, 2-D or
    # float arrays.
    for name, columns, value in [("two", {"tokens": "ndarray:int32", "text": "str"}, {"text": "a"}),
                                 ("untyped", {"tokens": "ndarray"}, {}), ("float", {"tokens": "ndarray:float32"}, {})]:
        arrays = [np.arange(4, dtype=np.float32 if name == "float" else np.int32)] * 3
        shard = _one_shard(mds_write(tmp_path / name, [{"tokens": a, **value} for a in arrays], columns, size_limit=None))
        assert shard.token_views() is None, name
    flat = _one_shard(mds_write(tmp_path / "twod", [{"tokens": np.ones((2, 3), np.int32)}] * 2,
                                {"tokens": "ndarray:int32"}, size_limit=None))
    assert flat.token_views() is None

    # A sample whose stored dimension disagrees with its bytes: declined, and get_item names what is wrong.
    root = mds_write(tmp_path / "bad", [{"tokens": np.arange(n, dtype=np.int32)} for n in (4, 5, 6)],
                     {"tokens": "ndarray:int32"}, size_limit=None)
    shard = _one_shard(root)
    raw = bytearray(shard.raw)
    raw[int(shard.offsets[1]) + 4 + 1] = 9  # sample 1: [size u32][ndim << 2 | width][dimension: 5 -> 9]
    from pipelines.mds.reader import MemoryShard

    bad = MemoryShard(bytes(raw), shard.offsets, ["tokens"], ["ndarray:int32"], [None])
    assert bad.token_views() is None
    with pytest.raises(ValueError, match=r"ndarray of int32 \(9,\) needs 36 bytes, the sample holds 20"):
        bad.get_item(1)
