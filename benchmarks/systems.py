"""The measured systems, one per child process: ``python benchmarks/systems.py NAME 'JSON PARAMS'``.

Prints one line ``BENCH_RESULT {json}``. Timing keys (seconds, ``time.perf_counter``):

* ``init_s``  framework start-up before any data work (``ray.init``; 0 for the others)
* ``ttfb_s``  from the start of data work (after init) to the first row in the consumer's hands
* ``total_s`` from the start of data work to the last row
* ``steady_tok_s`` tokens after the first batch / time after the first batch ("steady state")
* ``e2e_tok_s``   all tokens / ``total_s``

Every system gets the same text: the Alpaca prompt of :mod:`pipelines.sources.formats` followed by EOS.
Peers do *less* work than ``build_dataset`` (no label masks, and no packing except the eager path),
so ratios in our favour are conservative.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

RESULT_TAG = "BENCH_RESULT "


def emit(result: dict[str, Any]) -> None:
    print(RESULT_TAG + json.dumps(result), flush=True)


def alpaca_text(rec: dict[str, Any], eos: str) -> str:
    from pipelines.sources.formats import ALPACA_PROMPT, ALPACA_PROMPT_NO_INPUT

    inp = rec.get("input") or ""
    if inp.strip():
        prompt = ALPACA_PROMPT.format(instruction=rec["instruction"], input=inp)
    else:
        prompt = ALPACA_PROMPT_NO_INPUT.format(instruction=rec["instruction"])
    return prompt + rec["output"] + eos


def alpaca_batch_texts(batch: dict[str, list], eos: str) -> list[str]:
    inputs = batch.get("input") or [""] * len(batch["instruction"])
    return [alpaca_text({"instruction": i, "input": x, "output": o}, eos)
            for i, x, o in zip(batch["instruction"], inputs, batch["output"], strict=True)]


def read_records(data_dir: str) -> list[dict[str, Any]]:
    recs = []
    for p in sorted(Path(data_dir).glob("*.jsonl")):
        with open(p, encoding="utf-8") as f:
            recs.extend(json.loads(line) for line in f if line.strip())
    return recs


class Clock:
    """First-batch and end times, token counts."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.t_first: float | None = None
        self.tokens = 0
        self.tokens_first = 0
        self.rows = 0
        self.timeline: list[tuple[float, int]] = []  # (seconds since t0, cumulative tokens), first 500 batches

    def batch(self, tokens: int, rows: int) -> None:
        self.tokens += tokens
        self.rows += rows
        if len(self.timeline) < 500:
            self.timeline.append((round(time.perf_counter() - self.t0, 3), self.tokens))
        if self.t_first is None and rows:
            self.t_first = time.perf_counter()
            self.first_unix = time.time()  # the parent turns it into time from process start (cold_ttfb_s)
            self.tokens_first = self.tokens

    def result(self, init_s: float = 0.0, **extra: Any) -> dict[str, Any]:
        t_end = time.perf_counter()
        total = t_end - self.t0
        t_first = self.t_first if self.t_first is not None else t_end
        after = t_end - t_first
        steady = (self.tokens - self.tokens_first) / after if after > 0.05 and self.tokens > self.tokens_first else None
        e2e = self.tokens / total if total > 0 else None
        return {"init_s": init_s, "ttfb_s": t_first - self.t0, "total_s": total, "tokens": self.tokens,
                "rows": self.rows, "steady_tok_s": steady if steady is not None else e2e, "e2e_tok_s": e2e,
                "steady_is_e2e": steady is None, "timeline": self.timeline,
                "first_row_unix": getattr(self, "first_unix", None), **extra}


def load_hf_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    tok.backend_tokenizer.no_truncation()
    tok.model_max_length = 10**9
    return tok


def _eos_text(path: str) -> str:
    """The EOS token's text from ``tokenizer_config.json`` (a string, or ``{"content": ...}``)."""
    eos = json.loads((Path(path) / "tokenizer_config.json").read_text())["eos_token"]
    return eos["content"] if isinstance(eos, dict) else eos


# --------------------------------------------------------------------------- B1: raw tokenizer


def sys_raw(p: dict[str, Any]) -> dict[str, Any]:
    """The fast tokenizer alone (RAYON_NUM_THREADS is set by the parent): ``call`` is ``encode_batch_fast``
    (ids without offsets: the ceiling, and what ours calls for byte-level BPE) or ``encode_batch``."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(p["tokenizer"]) / "tokenizer.json"))
    tok.no_truncation()
    tok.no_padding()
    if p.get("texts") == "long":
        text = Path(p["long_file"]).read_text(encoding="utf-8")
        chunk = int(p.get("long_chars", 16000))
        texts = [text[i : i + chunk] for i in range(0, len(text), chunk)] * int(p.get("long_copies", 1))
    else:
        texts = [alpaca_text(r, p["eos"]) for r in read_records(p["data"])]
    bs = int(p.get("batch_size", 1024))
    encode = getattr(tok, p.get("call", "encode_batch_fast"))
    encode(texts[:bs])  # warm-up
    times, tokens = [], 0
    for _ in range(int(p.get("passes", 3))):
        t0 = time.perf_counter()
        tokens = 0
        for s in range(0, len(texts), bs):
            tokens += sum(len(e.ids) for e in encode(texts[s : s + bs]))
        times.append(time.perf_counter() - t0)
    t = float(np.median(times))
    return {"init_s": 0.0, "ttfb_s": None, "total_s": t, "tokens": tokens, "rows": len(texts),
            "steady_tok_s": tokens / t, "e2e_tok_s": tokens / t, "docs": len(texts),
            "mean_doc_tokens": tokens / max(1, len(texts)), "pass_s": times,
            "threads": os.environ.get("RAYON_NUM_THREADS"), "call": p.get("call", "encode_batch_fast")}


def sys_load(p: dict[str, Any]) -> dict[str, Any]:
    """Cold start of a tokenizer process: import + load, the way ours' actors do it (``pipelines.tokenize.stage``)
    and with ``tokenizers`` alone. The parent sets USE_TORCH etc. to compare."""
    t0 = time.perf_counter()
    import pipelines.tokenize.stage  # noqa: F401
    t1 = time.perf_counter()
    from transformers import AutoTokenizer

    t2 = time.perf_counter()
    AutoTokenizer.from_pretrained(p["tokenizer"])
    t3 = time.perf_counter()
    from tokenizers import Tokenizer

    Tokenizer.from_file(str(Path(p["tokenizer"]) / "tokenizer.json"))
    t4 = time.perf_counter()
    return {"pipelines_import_s": t1 - t0, "transformers_import_s": t2 - t1, "from_pretrained_s": t3 - t2,
            "tokenizers_only_s": t4 - t3, "total_s": t3 - t0, "torch_imported": "torch" in sys.modules}


# --------------------------------------------------------------------------- HF datasets streaming


def sys_hf_stream(p: dict[str, Any]) -> dict[str, Any]:
    """``load_dataset(..., streaming=True).map(batched=True)``, tokenizing with ``p["call"]``:

    * ``tok`` (default): the transformers call, ``tok(texts)["input_ids"]``, as the datasets docs show it;
    * ``fast``: ``tokenizers.Tokenizer.from_file(tokenizer.json)`` and its ``encode_batch_fast`` (ids only, no
      offsets), the call ours makes, without transformers: transformers 5's ``AutoTokenizer`` imports torch
      (through ``configuration_utils``, ``USE_TORCH=0`` notwithstanding), and this path needs neither. The caller
      sets ``USE_TORCH=0`` for datasets, whose ``load_dataset`` imports torch otherwise.
    """
    from datasets import load_dataset
    from datasets.utils.logging import disable_progress_bar

    disable_progress_bar()
    fast = p.get("call", "tok") == "fast"
    if fast:
        from tokenizers import Tokenizer

        backend = Tokenizer.from_file(str(Path(p["tokenizer"]) / "tokenizer.json"))
        backend.no_truncation()
        eos = _eos_text(p["tokenizer"])
    else:
        tok = load_hf_tokenizer(p["tokenizer"])
        eos = tok.eos_token
    files = sorted(str(x) for x in Path(p["data"]).glob("*.jsonl"))
    clock = Clock()

    def tokenize(batch: dict[str, list]) -> dict[str, list]:
        texts = alpaca_batch_texts(batch, eos)
        if fast:
            return {"input_ids": [e.ids for e in backend.encode_batch_fast(texts)]}
        return {"input_ids": tok(texts)["input_ids"]}

    ds = load_dataset("json", data_files=files, split="train", streaming=True)
    ds = ds.map(tokenize, batched=True, batch_size=int(p.get("batch_size", 1000)), remove_columns=["instruction", "input", "output"])
    for batch in ds.iter(batch_size=int(p.get("batch_size", 1000))):
        ids = batch["input_ids"]
        clock.batch(sum(len(x) for x in ids), len(ids))
    return clock.result(torch_imported="torch" in sys.modules)


# --------------------------------------------------------------------------- ours


def _ours_config(p: dict[str, Any]) -> Any:
    from pipelines.config import config_from_dict

    data = {"datasets": [{"path": p["data"], "format": "jsonl", "type": "alpaca"}]}
    data.update(p.get("data_overrides", {}))
    return config_from_dict({"model": {"tokenizer": p["tokenizer"]}, "data": data})


def _count(batch: Any) -> tuple[int, int, list[int]]:
    import pyarrow.compute as pc

    lens = pc.list_value_length(batch["input_ids"]).to_numpy(zero_copy_only=False)
    return int(lens.sum()), len(lens), lens.tolist()


def sys_ours(p: dict[str, Any]) -> dict[str, Any]:
    """``build_dataset`` on a fresh local Ray instance, iterated to the end."""
    import psutil
    import ray

    cfg = _ours_config(p)
    t0 = time.perf_counter()
    from pipelines.ray_local import init_local
    init_local(num_cpus=int(p["cpus"]), include_dashboard=False, log_to_driver=False,
             configure_logging=False)
    init_s = time.perf_counter() - t0
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    ctx.print_on_execution_start = False
    me = psutil.Process()
    baseline = sum(pr.memory_info().rss for pr in [me, *me.children(recursive=True)])

    from pipelines.stats import efficiency
    from pipelines.stream.dataset import build_dataset, data_report

    clock = Clock()
    ds = build_dataset(cfg, split="train")
    lengths: list[int] = []
    from benchlib import iter_ray_blocks

    for batch in iter_ray_blocks(ds):
        tokens, rows, lens = _count(batch)
        clock.batch(tokens, rows)
        lengths.extend(lens)
    res = clock.result(init_s)
    report = data_report(ds)
    try:
        res["ray_data_stats"] = ds.stats()[:8000]  # per-operator times, for diagnosing a slow run
    except Exception as err:
        res["ray_data_stats"] = f"(no stats: {err})"
    ray.shutdown()
    res.update(efficiency=efficiency(report), counters=report["counters"], baseline_rss_mb=baseline / 2**20,
               sequence_len=cfg.data.sequence_len)
    if p.get("row_lengths"):
        res["row_lengths"] = lengths
    return res


def sys_ours_local(p: dict[str, Any]) -> dict[str, Any]:
    """``iter_packed_local``: the same stages in this one process, no Ray (reference)."""
    from pipelines.stats import StatsSink, efficiency
    from pipelines.stream.stages import iter_packed_local

    cfg = _ours_config(p)
    sink = StatsSink()
    clock = Clock()
    for table in iter_packed_local(cfg, "train", sink):
        tokens, rows, _ = _count(table)
        clock.batch(tokens, rows)
    snap = sink.snapshot()
    return clock.result(efficiency=efficiency(snap))


def sys_stage(p: dict[str, Any]) -> dict[str, Any]:
    """Where ours' time goes, in one process: ``iter_packed_local`` with its Tokenizer and Packer timed.

    One thread drives the pass (read, then the tokenizer stage's stream, then packing); the Rust
    tokenizer's batch calls run on the stage's encode thread beside it. ``encode_s`` is the wall time of
    those calls; ``python_s`` the driving thread's CPU time in the stage's Python per sample (JSON parse,
    prompt formatting, labels, the output table); ``pack_s`` its CPU time packing; ``other_s`` the rest of
    its CPU time (reading and splitting files, turning unit rows into records, and the second tokenizer load
    inside ``iter_packed_local``). Threads: ``data.tokenize.threads`` =
    RAYON_NUM_THREADS (set by the parent).
    """
    import pipelines.stream.stages as pd
    from pipelines.sources.listing import resolve_sources
    from pipelines.stats import StatsSink

    timers = {"encode_s": 0.0, "python_s": 0.0, "pack_s": 0.0}

    def thread_timed(fn: Any, key: str) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            c0 = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                timers[key] += time.thread_time() - c0
        return timed

    class TimedTokenizer(pd.Tokenizer):
        _format_slice = thread_timed(pd.Tokenizer._format_slice, "python_s")
        _label = thread_timed(pd.Tokenizer._label, "python_s")
        _finish = thread_timed(pd.Tokenizer._finish, "python_s")

        def _encode(self, texts: list, add_special_tokens: bool) -> list:
            t0 = time.perf_counter()
            try:
                return super()._encode(texts, add_special_tokens)
            finally:
                timers["encode_s"] += time.perf_counter() - t0

    class TimedPacker(pd.Packer):
        __call__ = thread_timed(pd.Packer.__call__, "pack_s")

    pd.Tokenizer, pd.Packer = TimedTokenizer, TimedPacker
    threads = int(os.environ.get("RAYON_NUM_THREADS", "1"))
    cfg = _ours_config({**p, "data_overrides": {"tokenize": {"threads": threads}}})
    # Warm-up: load the tokenizer and touch the code paths once (not timed).
    TimedTokenizer(cfg.data, cfg.model, resolve_sources(cfg, "train"), StatsSink(), threads)
    timers.update(encode_s=0.0, python_s=0.0, pack_s=0.0)
    t0, c0 = time.perf_counter(), time.thread_time()
    tokens = 0
    for table in pd.iter_packed_local(cfg, "train", StatsSink()):
        tokens += _count(table)[0]
    total, thread_cpu = time.perf_counter() - t0, time.thread_time() - c0
    t = timers
    return {"init_s": 0.0, "ttfb_s": None, "total_s": total, "tokens": tokens, "threads": threads,
            "steady_tok_s": tokens / total, "e2e_tok_s": tokens / total, "encode_s": t["encode_s"],
            "python_s": t["python_s"], "pack_s": t["pack_s"], "other_s": thread_cpu - t["python_s"] - t["pack_s"],
            "encode_tok_s": tokens / t["encode_s"] if t["encode_s"] else None}


# --------------------------------------------------------------------------- eager (axolotl-style)


def sys_eager(p: dict[str, Any]) -> dict[str, Any]:
    """``datasets.map(num_proc=N)`` over the whole dataset, then whole-dataset FFD packing into rows."""
    import tempfile

    import pyarrow as pa
    from benchlib import ffd
    from datasets import load_dataset
    from datasets.utils.logging import disable_progress_bar

    disable_progress_bar()
    tok = load_hf_tokenizer(p["tokenizer"])
    eos = tok.eos_token
    seq = int(p.get("sequence_len", 2048))
    files = sorted(str(x) for x in Path(p["data"]).glob("*.jsonl"))

    def tokenize(batch: dict[str, list]) -> dict[str, list]:
        ids = tok(alpaca_batch_texts(batch, eos))["input_ids"]
        ids = [x[:seq] for x in ids]  # truncate, as axolotl does with sequence_len
        return {"input_ids": ids, "length": [len(x) for x in ids]}

    with tempfile.TemporaryDirectory(dir=p.get("tmp")) as cache:
        clock = Clock()
        ds = load_dataset("json", data_files=files, split="train", cache_dir=cache)
        ds = ds.map(tokenize, batched=True, num_proc=int(p.get("num_proc", 2)), remove_columns=ds.column_names,
                    load_from_cache_file=False)
        col = ds.with_format("arrow")["input_ids"]
        arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
        offsets = arr.offsets.to_numpy()
        values = arr.values.to_numpy(zero_copy_only=False)
        lengths = np.diff(offsets)
        bins = ffd(lengths, seq)
        for b in bins:
            row = np.concatenate([values[offsets[i] : offsets[i + 1]] for i in b])
            clock.batch(len(row), 1)
        res = clock.result(efficiency=float(lengths.sum()) / (len(bins) * seq), steady_is_e2e=True)
    res["steady_tok_s"] = res["e2e_tok_s"]  # nothing streams: the whole pass is the rate
    return res


# --------------------------------------------------------------------------- mosaic-streaming


def sys_prep_mds(p: dict[str, Any]) -> dict[str, Any]:
    from streaming import MDSWriter

    out = Path(p["out"])
    if (out / "index.json").exists():
        return {"written": 0}
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    cols = {"instruction": "str", "input": "str", "output": "str"}
    n = 0
    with MDSWriter(out=str(tmp), columns=cols, size_limit="8mb") as w:
        for r in read_records(p["data"]):
            w.write({k: r.get(k) or "" for k in cols})
            n += 1
    tmp.rename(out)
    return {"written": n}


def sys_mosaic(p: dict[str, Any]) -> dict[str, Any]:
    """mosaic ``StreamingDataset`` over local MDS shards + ``DataLoader(num_workers=N)``, tokenizing in ``__getitem__``.

    Set up as its best user would: the shards are read in place (``local=``, no ``remote``: nothing is
    copied into a cache inside the clock) and the tokenizer is loaded before the clock starts (the
    DataLoader's forked workers inherit it).
    """
    import torch
    from streaming import StreamingDataset
    from streaming.base.util import clean_stale_shared_memory

    clean_stale_shared_memory()
    tok_path = p["tokenizer"]
    bs = int(p.get("batch_size", 64))

    class Tokenized(StreamingDataset):
        tok = load_hf_tokenizer(tok_path)  # before the clock, as for every peer

        def __getitem__(self, idx: int) -> list[int]:
            rec = super().__getitem__(idx)
            return Tokenized.tok(alpaca_text(rec, Tokenized.tok.eos_token))["input_ids"]

    clock = Clock()
    ds = Tokenized(local=p["mds"], shuffle=False, batch_size=bs)
    dl = torch.utils.data.DataLoader(ds, batch_size=bs, num_workers=int(p.get("num_workers", 2)),
                                     collate_fn=lambda b: b)
    for batch in dl:
        clock.batch(sum(len(x) for x in batch), len(batch))
    return clock.result()


# --------------------------------------------------------------------------- LitData


def _identity(rec: dict[str, Any]) -> dict[str, Any]:
    return rec


def sys_prep_litdata(p: dict[str, Any]) -> dict[str, Any]:
    import litdata

    out = Path(p["out"])
    if (out / "index.json").exists():
        return {"written": 0}
    recs = [{k: r.get(k) or "" for k in ("instruction", "input", "output")} for r in read_records(p["data"])]
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    litdata.optimize(fn=_identity, inputs=recs, output_dir=str(tmp), chunk_bytes="8MB", num_workers=1,
                     mode="overwrite", verbose=False)
    tmp.rename(out)
    return {"written": len(recs)}


def sys_litdata(p: dict[str, Any]) -> dict[str, Any]:
    """LitData ``StreamingDataset`` + ``StreamingDataLoader(num_workers=N)``, tokenizing in ``__getitem__``."""
    import litdata

    tok_path = p["tokenizer"]
    bs = int(p.get("batch_size", 64))

    class Tokenized(litdata.StreamingDataset):
        tok = load_hf_tokenizer(tok_path)  # before the clock, as for every peer

        def __getitem__(self, idx: Any) -> list[int]:
            rec = super().__getitem__(idx)
            return Tokenized.tok(alpaca_text(rec, Tokenized.tok.eos_token))["input_ids"]

    clock = Clock()
    ds = Tokenized(input_dir=p["litdata"], shuffle=False)
    dl = litdata.StreamingDataLoader(ds, batch_size=bs, num_workers=int(p.get("num_workers", 2)),
                                     collate_fn=lambda b: b)
    for batch in dl:
        clock.batch(sum(len(x) for x in batch), len(batch))
    return clock.result()


SYSTEMS = {
    "raw": sys_raw,
    "hf_stream": sys_hf_stream,
    "ours": sys_ours,
    "ours_local": sys_ours_local,
    "stage": sys_stage,
    "load": sys_load,
    "eager": sys_eager,
    "prep_mds": sys_prep_mds,
    "mosaic": sys_mosaic,
    "prep_litdata": sys_prep_litdata,
    "litdata": sys_litdata,
}


def main() -> None:
    name, params = sys.argv[1], json.loads(sys.argv[2])
    emit(SYSTEMS[name](params))


if __name__ == "__main__":
    main()
