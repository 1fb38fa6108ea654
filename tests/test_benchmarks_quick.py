"""`benchmarks/run.py --quick` end to end: it must write the tables and plots with real numbers.

The quick run uses tiny data and one repeat (under 3 minutes on a quiet 2-core machine; the timeout
leaves room for a busy one). It needs the `bench` extra (HF datasets, matplotlib, psutil) and the real
data in ../shared/data; without them it skips with the reason.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess

import pytest
from conftest import BENCH_KEPT_SECTION, ROOT, bench_kept_marker, needs_shared

pytest.importorskip("datasets", reason="benchmarks need the bench extra: pip install -e '.[bench]'")
pytest.importorskip("matplotlib", reason="benchmarks need the bench extra: pip install -e '.[bench]'")
pytest.importorskip("psutil", reason="benchmarks need the bench extra: pip install -e '.[bench]'")

PLOTS = ("b2_throughput.png", "b3_ttfb_rss.png", "b4_packing.png", "b4_row_lengths.png")
KEPT_MARKER, KEPT_SECTION = bench_kept_marker(), BENCH_KEPT_SECTION


@pytest.mark.slow
@needs_shared
@pytest.mark.timeout(900)
def test_quick_writes_tables_and_plots(quick_run):
    out, md = quick_run.out, quick_run.md
    for title in ("## Targets", "## B1", "## B2", "## B3", "## B4", "## B5", "## B6", "## B7", "## B8"):
        assert title in md, f"{title} missing from BENCHMARKS.md"
    assert "stale tables" not in md and md.endswith(f"\n{KEPT_MARKER}\n\n{KEPT_SECTION}")  # kept, once
    assert md.count(KEPT_MARKER) == 1
    head = md.splitlines()[:8]  # the command that produced it is on top
    assert any(line.startswith("Produced by: `.venv/bin/python benchmarks/run.py --quick") for line in head), head
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=ROOT).stdout.strip()
    assert f"- commit: {commit}" in md  # the checkout the numbers came from (and whether it had changes)
    for name in PLOTS:
        png = out / "results" / name
        assert png.is_file() and png.stat().st_size > 5000, f"plot {name} missing or empty"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"results/{name}" in md


@pytest.mark.slow
@needs_shared
@pytest.mark.timeout(900)
def test_quick_numbers_are_real(quick_run):
    md, results = quick_run.md, quick_run.results
    ing = results["ingest"]
    # B1 ceiling and the systems of B2 measured real throughput.
    for key in ("raw 1t", "raw 2t", "raw offsets 2t", "hf_stream_tok", "hf_stream_fast", "hf_stream"):
        assert "error" not in ing[key], ing[key]
        assert ing[key]["steady_tok_s"] > 0 and ing[key]["tokens"] > 100_000
    # HF streaming both ways: the same tokens, the fast path without torch; "hf_stream" is the faster one.
    assert ing["hf_stream_tok"]["tokens"] == ing["hf_stream_fast"]["tokens"]
    assert ing["hf_stream_fast"]["torch_imported"] is False
    best = ing["hf_stream"]["variant"]
    other = {"hf_stream_tok": "hf_stream_fast", "hf_stream_fast": "hf_stream_tok"}[best]
    assert ing["hf_stream"]["e2e_tok_s"] == ing[best]["e2e_tok_s"]  # the variant's own figures
    assert max(ing[best]["steady_tok_s"], ing[best]["e2e_tok_s"]) >= min(ing[other]["steady_tok_s"],
                                                                         ing[other]["e2e_tok_s"])
    ours = ing["ours"]
    assert "error" not in ours, ours
    assert ours["steady_tok_s"] > 0 and ours["e2e_tok_s"] > 0 and ours["init_s"] > 0 and ours["ttfb_s"] > 0
    assert ours["peak_rss_mb"] > 0
    assert 0 < ours["efficiency"] <= 1
    # Every system of B2 either measured or said why not.
    for key in ("eager", "mosaic", "litdata"):
        r = results["B2"][key]
        assert ("error" in r and r["error"]) or r["steady_tok_s"] > 0, r
    # mosaic ran in its own venv: the versions name the release it ran, not "not installed".
    if "error" not in results["B2"]["mosaic"]:
        assert re.match(r"0\.\d+\.\d+ \(", results["versions"]["mosaicml-streaming"]), results["versions"]
    # The same tokens reach every consumer (same data, same text, same tokenizer).
    assert results["B2"]["eager"].get("tokens", ing["hf_stream"]["tokens"]) == ing["hf_stream"]["tokens"]
    # B3: time to first row and RSS at every size.
    for point in results["B3"]["points"].values():
        for key in ("ours", "eager", "hf_stream"):
            assert point[key]["ttfb_s"] >= 0 and point[key]["peak_rss_mb"] > 0, point[key]
    # B4: efficiencies in (0, 1], shares in [0, 1], for every strategy, sequence length and tokenizer.
    rows = results["B4"]["rows"]
    assert {r["sequence_len"] for r in rows} == {512, 1024, 2048}
    assert {r["tokenizer"] for r in rows} == {"gpt2", "smollm2-135m"}
    assert len({r["strategy"] for r in rows}) == 5
    for r in rows:
        assert 0 < r["efficiency"] <= 1, r
        assert 0 <= r["truncated_share"] <= 1 and 0 <= r["dropped_share"] <= 1 and 0 <= r["split_share"] <= 1
    bfd = [r for r in rows if r["strategy"].startswith("bfd (ours") and r["split_share"] == 0]
    assert len(bfd) == 6  # bfd never splits a sample
    # Tables in the markdown carry numbers, not placeholders, for the measured rows.
    assert re.search(r"\| Alpaca prompts \(short\) \| encode_batch_fast \| 2 \| \d+\.\d+ M", md)
    assert re.search(r"\| Alpaca prompts \(short\) \| encode_batch \(offsets\) \| 2 \| \d+\.\d+ M", md)
    assert re.search(r"\| gpt2 \| 2048 \| bfd \(ours[^|]*\| \d+\.\d+% \|", md)
    # Skipped B5-B7 are reported, not dropped.
    assert md.count("not available: not run (--only / --skip)") == 3


@pytest.mark.slow
@needs_shared
@pytest.mark.timeout(900)
def test_quick_feeder_scale_delivers_every_token_to_the_ranks(quick_run):
    """B8 (feeder_scale.py --quick): the feeder and its peer, Ray Data's ds.streaming_split(N), each deliver the
    whole stream to N ranks, as fast as the ranks take it and at a set step time."""
    md, results = quick_run.md, quick_run.results
    b8 = results["B8"]
    assert b8["status"] == "ok", b8
    r, paced = b8["results"]  # free-running, then at a set step time (run.run_b8)
    assert r["tokens"] == r["rows"] * 2048 and r["ceiling"]["tokens"] == r["tokens"]
    for n, per in r["per_n"].items():
        for key in ("feeder", "split"):  # the feeder and its peer, ds.streaming_split(N)
            assert per[key]["tokens"] == r["tokens"], (n, key, per[key])  # every row, once, to some rank
            assert per[key]["tokens_per_s"] > 0 and per[key]["wait_p99_ms"] >= per[key]["wait_p50_ms"] >= 0, (n, key)
        assert per["feeder"]["cpu_s_per_m_tokens"] > 0 and per["feeder"]["feeder_peak_rss_mb"] > 0
        assert r["split_ratio"][n] == pytest.approx(per["feeder"]["tokens_per_s"] / per["split"]["tokens_per_s"])
    assert set(r["per_n"]) == {"2", "4"}
    assert "| 4 | feeder |" in md and "| 4 | ds.streaming_split(N) (peer) |" in md
    # The opening table holds these runs' own figures: B8's at each N, and B2's ours against each peer that ran.
    glance = md.split("## At a glance", 1)[1].split("\n## ", 1)[0]
    for n in (2, 4):
        feeder, split = (r["per_n"][str(n)][k]["tokens_per_s"] / 1e6 for k in ("feeder", "split"))
        row = f"| B8 {n} ranks, delivered tokens (one run) | the feeder | ds.streaming_split(N) | - | - | {feeder:.3g} / {split:.3g} M tok/s | {feeder / split:.2f}x |"
        assert row in glance, (row, glance)
    # At a set step time (50 ms, 20 steps): every rank gets each of its steps, and spends at least the step time on
    # each, so the run lasts at least 20 x 50 ms, and the ranks' wait is a share of it.
    assert paced["step_ms"] == 50 and paced["steps"] == 20 and set(paced["per_n"]) == {"2", "4"}
    for n, per in paced["per_n"].items():
        for key in ("feeder", "split"):
            p = per[key]
            assert p["tokens"] == int(n) * 8 * 20 * 2048 and p["steps"] >= 19, (n, key, p)
            assert p["wall_s"] >= 19 * 0.05 and 0 <= p["data_wait_pct"] < 100, (n, key, p)
        assert f"| B8 {n} ranks at a set step time (50 ms, 20 steps; one run) | the feeder: data wait " \
               f"{per['feeder']['data_wait_pct']:.2f}% |" in glance, glance
    ours, hf = results["ingest"]["ours"], results["ingest"]["hf_stream"]
    b2 = [line for line in glance.splitlines() if line.startswith("| B2 ingest: JSONL -> packed rows | ours: build_dataset")]
    assert len(b2) == 1 + sum("error" not in results["B2"][k] for k in ("litdata", "mosaic", "eager")), glance
    assert f"| {ours['ttfb_s']:.3g} / {hf['ttfb_s']:.3g} |" in b2[0] and "HF datasets streaming + map" in b2[0], b2[0]


def _load_run_module():
    spec = importlib.util.spec_from_file_location("bench_run", ROOT / "benchmarks" / "run.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_external_scripts_are_run_or_reported_not_available(tmp_path, monkeypatch):
    """B5-B7: a script that is there runs and its RESULT line is read; a missing or failing one is "not available"."""
    run = _load_run_module()
    (tmp_path / "train_stall.py").write_text(
        "import json\nprint('| feed | wait |')\nprint('|---|---|')\nprint('| real | 3.2 |')\n"
        "print('RESULT ' + json.dumps({'build_dataset': {'data_wait_pct': 3.2}, 'ratio': 0.97}))\n")
    (tmp_path / "mds_read.py").write_text("import sys\nprint('boom', file=sys.stderr)\nsys.exit(3)\n")
    monkeypatch.setattr(run.bl, "BENCH_DIR", tmp_path)
    ctx = {"quick": False, "external_timeout": 60}
    ok = run.run_external("train_stall.py", ctx)
    assert ok["status"] == "ok" and ok["results"] == [{"build_dataset": {"data_wait_pct": 3.2}, "ratio": 0.97}]
    assert "| real | 3.2 |" in run.external_md(ok)
    assert run._b5_rows(ok) == [["B5", "data wait < 5% of step time", "3.20%", "met"],
                                ["B5", ">= 0.95x synthetic steps/s", "0.970x", "met"]]
    failed = run.run_external("mds_read.py", ctx)
    assert failed["status"] == "not available" and "exit 3" in failed["why"] and "boom" in failed["why"]
    missing = run.run_external("resume.py", ctx)
    assert missing["status"] == "not available" and "not there" in missing["why"]
    assert run.external_md(missing).startswith("not available")
    assert run._ratio_rows(failed, "B6", [("read_local_ratio", "t", 1.0, True)]) == [["B6", "t", "not available",
                                                                                      "not available"]]


def test_b6_b7_target_rows_come_from_the_result_line():
    """B6 (higher is better) and B7 (lower is better) rows carry the measured ratio and a real verdict."""
    run = _load_run_module()
    b6 = {"status": "ok", "results": [{"read_local_ratio": 0.8, "read_s3_ratio": 1.31}]}
    spec6 = [("read_local_ratio", "local", 1.0, True), ("read_s3_ratio", "s3", 1.0, True)]
    assert run._ratio_rows(b6, "B6", spec6) == [["B6", "local", "0.80x", "MISSED"], ["B6", "s3", "1.31x", "met"]]
    spec7 = [("ratio_90_10", "resume", 1.2, False)]
    assert run._ratio_rows({"status": "ok", "results": [{"ratio_90_10": 0.79}]}, "B7", spec7) == [
        ["B7", "resume", "0.79x", "met"]]
    assert run._ratio_rows({"status": "ok", "results": [{"ratio_90_10": 1.5}]}, "B7", spec7)[0][3] == "MISSED"
    # A RESULT line without the field is pointed at, not invented.
    assert run._ratio_rows({"status": "ok", "results": [{}]}, "B7", spec7)[0][2] == "see section"


def test_b4_split_share_is_measured_from_the_rows(monkeypatch):
    """B4's split column counts samples found in several rows: concat splits here, bfd and first-fit do not,
    and a packer that did split would be reported (the column is not a constant)."""
    import numpy as np

    from pipelines.stream.packing import Samples

    spec = importlib.util.spec_from_file_location("packing_bench", ROOT / "benchmarks" / "packing_bench.py")
    pb = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pb)
    assert pb.split_samples([np.array([1, 2]), np.array([2, 3]), np.array([4])]) == 1
    lengths = [30, 30, 30, 50, 10, 25]  # 175 tokens: concat at 64 cuts samples at row borders
    s = Samples(np.arange(len(lengths), dtype=np.int64), [np.arange(n, dtype=np.int32) + 4 for n in lengths],
                [np.arange(n, dtype=np.int32) + 4 for n in lengths])
    rows = {r["strategy"]: r for r in pb.measure(s, 64)}
    assert rows[pb.CONCAT]["split_share"] > 0
    for name in (pb.BFD_DEFAULT, pb.BFD_SMALL, pb.GREEDY, pb.FFD):
        assert rows[name]["split_share"] == 0 and rows[name]["truncated_share"] == 0, rows[name]
        assert sum(rows[name]["row_lengths"]) == sum(lengths)  # every token placed, none cut

    import pipelines.stream.packing as packing

    real = packing.pack_samples

    def splitting(samples, opts, counts, *args):  # a bfd that puts half of one sample in a row of its own
        out = real(samples, opts, counts)
        if opts.strategy == "bfd" and out.sample_ids:
            out.ids.append(out.ids[0][:1])
            out.sample_ids.append(out.sample_ids[0][:1])
        return out

    monkeypatch.setattr(packing, "pack_samples", splitting)
    assert {r["strategy"]: r for r in pb.measure(s, 64)}[pb.BFD_DEFAULT]["split_share"] > 0

