"""All benchmarks (issue 5), side by side on the same cores, data and tokenizer; writes BENCHMARKS.md + plots.

    .venv/bin/python benchmarks/run.py                 # full: ~55 min on 2 cores (86 with --records 199800); BENCHMARKS.md, benchmarks/results/
    .venv/bin/python benchmarks/run.py --quick         # tiny data, 1 repeat, < 3 min; writes to a temp dir
    .venv/bin/python benchmarks/run.py --quick --out DIR

B1 tokenizer ceiling, B2 ingest vs peers, B3 time to first row and peak RSS vs data size, B4 packing
efficiency, B5 data-wait while training (``benchmarks/train_stall.py``), B6 MDS read
(``benchmarks/mds_read.py``), B7 resume latency (``benchmarks/resume.py``), B8 feeder scale
(``benchmarks/feeder_scale.py``). A benchmark whose
prerequisite is missing prints "not available" instead of failing the run.

External scripts (B5-B8) are run as ``python benchmarks/X.py [--quick]``; their stdout is copied into
BENCHMARKS.md (markdown table lines as they are, everything else as a text block). A line
``BENCH_RESULT {json}`` in their output is kept in results.json as well. Sections of BENCHMARKS.md
below :data:`KEPT_MARKER` (other scripts' measurements) are kept as they are.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import benchlib as bl  # noqa: E402
import ingest  # noqa: E402
import packing_bench  # noqa: E402

NA = "not available"
RESULT_TAGS = (bl.RESULT_TAG, "RESULT ")  # machine-readable result lines of the external scripts
FULL_CMD = ".venv/bin/python benchmarks/run.py"


# --------------------------------------------------------------------------- B1


def run_b1(ctx: dict[str, Any]) -> dict[str, Any]:
    """Raw encode_batch_fast, short (Alpaca) and long (tinyshakespeare, 16k-character chunks) documents;
    encode_batch (with offsets) on the short ones at 2 threads."""
    out: dict[str, Any] = {}
    ing = ctx["ingest"]
    out["short 1t"], out["short 2t"], out["short offsets 2t"] = ing.get("raw 1t"), ing.get("raw 2t"), ing.get("raw offsets 2t")
    data_dir = ing.get("_data", {}).get("dir")
    for threads in (1, 2):
        out[f"stage {threads}t"] = (
            bl.run_system("stage", {"tokenizer": str(bl.GPT2), "data": data_dir},
                          env={"RAYON_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "true"}, log_dir=ctx["logs"])
            if data_dir else {"error": NA})
    if not bl.SHAKESPEARE.is_file():
        out["long 1t"] = out["long 2t"] = {"error": f"{NA}: {bl.SHAKESPEARE} missing"}
        return out
    for threads in (1, 2):
        params = {"tokenizer": str(bl.GPT2), "texts": "long", "long_file": str(bl.SHAKESPEARE), "long_chars": 16000,
                  "long_copies": 1 if ctx["quick"] else 4, "passes": max(3, ctx["repeats"])}
        out[f"long {threads}t"] = bl.run_system("raw", params, env={"RAYON_NUM_THREADS": str(threads),
                                                                     "TOKENIZERS_PARALLELISM": "true"},
                                                log_dir=ctx["logs"])
    return out


def b1_md(b1: dict[str, Any]) -> str:
    rows = []
    keys = [("short", 1), ("short", 2), ("short offsets", 2), ("long", 1), ("long", 2)]
    labels = {"short": "Alpaca prompts (short)", "long": "tinyshakespeare 16k-char chunks (long)"}
    for docs, t in keys:
        r = b1.get(f"{docs} {t}t") or {"error": NA}
        label = labels[docs.split()[0]]
        call = "encode_batch (offsets)" if "offsets" in docs else "encode_batch_fast"
        if "error" in r:
            rows.append([label, call, t, NA, "-", "-", "-", r["error"][:120]])
            continue
        rows.append([label, call, t, bl.fmt_rate(r["steady_tok_s"]), r.get("docs"), r.get("mean_doc_tokens"),
                     r.get("tokens"), f"median of {len(r.get('pass_s') or [])} passes"])
    table = bl.md_table(["documents", "call", "threads", "tokens/s", "docs", "mean tokens/doc", "tokens/pass", "repeats"], rows)
    srows = []
    for t in (1, 2):
        r = b1.get(f"stage {t}t") or {"error": NA}
        if "error" in r:
            srows.append([t, NA, "-", "-", "-", "-", "-", "-", r["error"][:120]])
            continue
        srows.append([t, bl.fmt_rate(r["e2e_tok_s"]), bl.fmt_rate(r.get("encode_tok_s")), r.get("total_s"),
                      r.get("encode_s"), r.get("python_s"), r.get("pack_s"), r.get("other_s")])
    stage = bl.md_table(["threads", "whole pass tok/s", "its encode calls tok/s", "whole pass s", "encode s (wall)",
                         "Python per sample CPU s (parse, format, labels)", "pack CPU s", "read + rest CPU s"], srows)
    return (table + "\n\nOurs' stages in one process (`iter_packed_local` on the B2 data, Tokenizer and Packer "
            "timed; one run): how close the pass gets to the ceiling. The encode calls run on the tokenizer stage's "
            "encode thread; the CPU columns are the thread that drives the pass (read, the stage's Python, packing), "
            "which runs beside them on the same cores.\n\n" + stage)


# --------------------------------------------------------------------------- B2


def run_b2(ctx: dict[str, Any]) -> dict[str, Any]:
    """Peers on the ingest data (ours, raw and HF streaming come from the ingest run)."""
    data_dir = Path(ctx["ingest"]["_data"]["dir"])
    n = ctx["records"]
    work, reps, kw = ctx["work"], ctx["repeats"], {"log_dir": ctx["logs"]}
    tok = str(bl.GPT2)
    out: dict[str, Any] = {}
    (work / "tmp").mkdir(parents=True, exist_ok=True)
    print("  eager datasets.map(num_proc=2) + FFD ...", flush=True)
    out["eager"] = bl.repeat_system("eager", {"tokenizer": tok, "data": str(data_dir), "num_proc": ctx["cpus"],
                                              "tmp": str(work / "tmp")}, reps,
                                    env={"RAYON_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}, **kw)
    print("  mosaic StreamingDataset + DataLoader(num_workers=2) ...", flush=True)
    mds = work / "mds" / f"alpaca_{n}"
    prep = bl.run_system("prep_mds", {"data": str(data_dir), "out": str(mds)}, **kw)
    out["mosaic"] = prep if "error" in prep else bl.repeat_system(
        "mosaic", {"tokenizer": tok, "mds": str(mds), "num_workers": ctx["cpus"], "tmp": str(work / "tmp")}, reps,
        env={"TOKENIZERS_PARALLELISM": "false"}, **kw)
    print("  LitData StreamingDataset + StreamingDataLoader(num_workers=2) ...", flush=True)
    try:
        import litdata  # noqa: F401
    except Exception as err:
        out["litdata"] = {"error": f"{NA}: litdata does not import here ({type(err).__name__}: {err})"}
    else:
        lit = work / "litdata" / f"alpaca_{n}"
        prep = bl.run_system("prep_litdata", {"data": str(data_dir), "out": str(lit)}, **kw)
        out["litdata"] = prep if "error" in prep else bl.repeat_system(
            "litdata", {"tokenizer": tok, "litdata": str(lit), "num_workers": ctx["cpus"]}, reps,
            env={"TOKENIZERS_PARALLELISM": "false"}, **kw)
    return out


PEERS = {"hf_stream": "HF datasets streaming + map", "mosaic": "mosaic StreamingDataset + DataLoader(2 workers)",
         "eager": "axolotl-style eager: datasets.map(num_proc=2) + FFD", "litdata": "LitData StreamingDataLoader(2 workers)"}


def b2_systems(ctx: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    ing, b2 = ctx["ingest"], ctx["results"].get("B2", {})
    best = ing.get("ours_best")
    rows = [("ours: build_dataset, default config", ing.get("ours"))]
    if best and best != "default":
        rows.append((f"ours: build_dataset, best setting ({best})", ing["ours_sweep"][best]))
    if "ours_local" in ing:
        rows.append(("ours: iter_packed_local (1 process, no Ray)", ing["ours_local"]))
    for variant, how in (("hf_stream_tok", "tok(texts)"), ("hf_stream_fast", "tokenizers encode_batch_fast")):
        if variant in ing:
            best = " (best HF)" if (ing.get("hf_stream") or {}).get("variant") == variant else ""
            rows.append((f"{PEERS['hf_stream']}, {how}{best}", ing[variant]))
    if not any(v in ing for v in ("hf_stream_tok", "hf_stream_fast")):
        rows.append((PEERS["hf_stream"], ing.get("hf_stream")))
    rows += [(PEERS[k], b2.get(k)) for k in ("mosaic", "eager", "litdata")]
    return [(label, r or {"error": NA}) for label, r in rows]


def b2_headline(ctx: dict[str, Any]) -> list[dict[str, Any]]:
    """B2's rows of the opening table: ours (default config) against each peer, HF as its faster variant."""
    ing, b2 = ctx["ingest"], ctx["results"].get("B2", {})
    ours = ing.get("ours")
    if not ours or "error" in ours:
        return []

    def fig(label: str, r: dict[str, Any]) -> dict[str, Any]:
        steady = r.get("steady_tok_s")
        return bl.figures(label, r.get("total_s"), r.get("ttfb_s"), steady / 1e6 if steady else None,
                          [x.get("total_s") for x in r.get("runs") or []])

    hf = ing.get("hf_stream") or {}
    how = {"hf_stream_tok": "tok(texts)", "hf_stream_fast": "encode_batch_fast"}.get(hf.get("variant", ""))
    rows = []
    for key, r in (("hf_stream", hf), *((k, b2.get(k)) for k in ("litdata", "mosaic", "eager"))):
        if r and "error" not in r and r.get("total_s"):
            label = PEERS[key] + (f", {how} (its faster variant here)" if key == "hf_stream" and how else "")
            rows.append(bl.headline("B2 ingest: JSONL -> packed rows", "M tok/s",
                                    fig("ours: build_dataset, default config", ours), fig(label, r)))
    return rows


def headline_md(ctx: dict[str, Any]) -> str:
    """The opening table: every workload's ours against the best variant of each peer, from this run alone."""
    rows = b2_headline(ctx)
    for key in ("B5", "B6", "B7", "B8"):
        for parsed in (ctx["results"].get(key) or {}).get("results") or []:
            rows += parsed.get("headline") or []
    if not rows:
        return f"{NA}: no benchmark of this run gave a row"

    def both(row: dict[str, Any], key: str) -> str:
        a, b = row["ours"].get(key), row["peer"].get(key)
        return "-" if a is None and b is None else f"{bl.fmt_num(a)} / {bl.fmt_num(b)}"

    def ratio(a: float | None, b: float | None) -> str:
        return "-" if not a or not b else f"{a / b:.2f}x"

    def spread(f: dict[str, Any]) -> str:
        lo_hi = f.get("spread_s")
        return f"{f['runs']} run(s)" + (f", {lo_hi[0]:.2f}-{lo_hi[1]:.2f} s" if lo_hi else "")

    table = [[r["workload"], r["ours"]["label"], r["peer"]["label"], both(r, "first_s"),
              ratio(r["peer"].get("first_s"), r["ours"].get("first_s")),
              both(r, "steady") + (f" {r['unit']}" if r["unit"] != "-" and r["ours"].get("steady") else ""),
              ratio(r["ours"].get("steady"), r["peer"].get("steady")), both(r, "total_s"),
              ratio(r["peer"].get("total_s"), r["ours"].get("total_s")),
              f"{spread(r['ours'])}; {spread(r['peer'])}"] for r in rows]
    return bl.md_table(["workload", "ours", "peer (its best variant)", "first batch or row s, ours / peer",
                        "first, peer / ours", "steady after it, ours / peer", "steady, ours / peer", "total s, ours / peer",
                        "total time, peer / ours", "runs and spread of each (ours; peer)"], table)


def best_peer(ctx: dict[str, Any]) -> tuple[str | None, dict[str, Any] | None]:
    ing, b2 = ctx["ingest"], ctx["results"].get("B2", {})
    peers = {"hf_stream": ing.get("hf_stream"), **{k: b2.get(k) for k in ("mosaic", "eager", "litdata")}}
    ok = {k: v for k, v in peers.items() if v and "error" not in v and v.get("steady_tok_s")}
    if not ok:
        return None, None
    ceiling = ing.get("raw 2t")
    # A peer whose "steady" rate is a burst above the tokenizer ceiling is ranked by its end-to-end rate.
    k = max(ok, key=lambda k: ok[k]["e2e_tok_s"] if ingest.burst(ok[k], ceiling) else ok[k]["steady_tok_s"])
    return PEERS[k], ok[k]


def _note(r: dict[str, Any]) -> str:
    if r.get("system") == "eager":
        return "nothing streams: steady = whole pass"
    if r.get("steady_is_e2e"):
        return "one batch only: steady = end to end"
    return ""


def b2_md(ctx: dict[str, Any]) -> str:
    ceiling = ctx["ingest"].get("raw 2t")
    peer_label, peer = best_peer(ctx)
    rows = []
    for label, r in b2_systems(ctx):
        if "error" in r:
            rows.append([label, NA, *["-"] * 10, r["error"][:160]])
            continue
        rows.append([label, ingest.steady_text(r, ceiling), bl.fmt_rate(r.get("e2e_tok_s")),
                     ingest.ratio(r, ceiling), ingest.ratio(r, ceiling, "e2e_tok_s"), ingest.ratio(r, peer),
                     r.get("init_s"), r.get("ttfb_s"), r.get("cold_ttfb_s"), r.get("peak_rss_mb"),
                     r.get("cpu_s_per_mtok"), r.get("repeats", 1), _note(r)])
    table = bl.md_table(["system", "steady tok/s (after 1st row)", "end-to-end tok/s", "x B1 2t (steady)",
                         "x B1 2t (e2e)", "x best peer (steady)", "init s", "first row s (after init)",
                         "first row s (from process start)", "peak RSS MB", "CPU s / M tok", "repeats", "note"], rows)
    return table + f"\n\nBest peer (steady state): {peer_label or NA}."


def sweep_md(ctx: dict[str, Any]) -> str:
    ing = ctx["ingest"]
    rows = []
    for name, r in ing.get("ours_sweep", {}).items():
        setting = json.dumps(ingest.POOL_SETTINGS[name]) if ingest.POOL_SETTINGS[name] else "config defaults"
        if "error" in r:
            rows.append([name, setting, NA, "-", "-", "-", "-", "-", r["error"][:160]])
            continue
        rows.append([name + (" (best)" if name == ing.get("ours_best") else ""), setting,
                     bl.fmt_rate(r.get("steady_tok_s")), bl.fmt_rate(r.get("e2e_tok_s")),
                     ingest.ratio(r, ing.get("raw 2t")), r.get("ttfb_s"), r.get("peak_rss_mb"),
                     r.get("cpu_s_per_mtok"), r.get("repeats", 1)])
    return bl.md_table(["setting", "data.tokenize", "steady tok/s", "end-to-end tok/s", "x B1 (2t)", "first row s",
                        "peak RSS MB", "CPU s / M tok", "repeats"], rows)


# --------------------------------------------------------------------------- B3


def b3_sizes(records: int, quick: bool = False) -> list[int]:
    """1x, 4x, 16x where 16x is the B2 data (quick: 1x and 16x only)."""
    if quick:
        return [max(1, round(records / 16)), records]
    return [max(1, round(records / 16)), max(1, round(records / 4)), records]


def run_b3(ctx: dict[str, Any]) -> dict[str, Any]:
    """ours / eager / HF streaming at 1x, 4x, 16x; the 16x point is the B2 data (reused)."""
    sizes = b3_sizes(ctx["records"], ctx["quick"])
    (ctx["work"] / "tmp").mkdir(parents=True, exist_ok=True)
    work, reps, kw, cpus = ctx["work"], ctx["repeats"], {"log_dir": ctx["logs"]}, ctx["cpus"]
    ing, b2 = ctx["ingest"], ctx["results"].get("B2", {})
    out: dict[str, Any] = {"sizes": sizes, "points": {}}
    fast_hf = (ing.get("hf_stream") or {}).get("variant") == "hf_stream_fast"  # B2's better HF variant
    for n in sizes:
        data_dir = bl.write_alpaca_jsonl(work, n)
        mb = bl.data_bytes(data_dir) / 1e6
        if n == ctx["records"]:
            point = {"ours": ing.get("ours"), "eager": b2.get("eager"), "hf_stream": ing.get("hf_stream")}
        else:
            print(f"  B3 {n} records ({mb:.1f} MB) ...", flush=True)
            point = {
                "ours": bl.repeat_system("ours", ingest.ours_params(data_dir, cpus), reps, **kw),
                "eager": bl.repeat_system("eager", {"tokenizer": str(bl.GPT2), "data": str(data_dir), "num_proc": cpus,
                                                    "tmp": str(work / "tmp")}, reps,
                                          env={"RAYON_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}, **kw),
                "hf_stream": bl.repeat_system("hf_stream", {"tokenizer": str(bl.GPT2), "data": str(data_dir),
                                                            "call": "fast" if fast_hf else "tok"}, reps,
                                              env={"RAYON_NUM_THREADS": str(cpus), **({"USE_TORCH": "0"} if fast_hf
                                                                                     else {})}, **kw),
            }
        out["points"][str(n)] = {"mb": mb, **{k: v or {"error": NA} for k, v in point.items()}}
    # What a tokenizer actor pays before its first batch: imports + tokenizer load, in a fresh process.
    for label, env in (("as configured", {}), ("USE_TORCH=0", {"USE_TORCH": "0", "USE_TF": "0", "USE_FLAX": "0"})):
        out.setdefault("actor_start", {})[label] = bl.run_system("load", {"tokenizer": str(bl.GPT2)}, env=env, **kw)
    return out


B3_LABELS = {"ours": "ours build_dataset (default)", "eager": "eager map(num_proc=2)+FFD", "hf_stream": "HF streaming"}


def b3_md(b3: dict[str, Any]) -> str:
    sizes = b3["sizes"]
    rows = []
    for sys_key, label in B3_LABELS.items():
        for i, n in enumerate(sizes):
            p = b3["points"][str(n)]
            r = p[sys_key]
            mult = f"{round(n / sizes[0])}x"
            if "error" in r:
                rows.append([label, mult, n, p["mb"], NA, "-", "-", "-", "-", r["error"][:120]])
                continue
            base = b3["points"][str(sizes[0])][sys_key]
            growth = ""
            if i and "error" not in base and base.get("ttfb_s") and base.get("peak_rss_mb"):
                growth = f"TTFB x{r['ttfb_s'] / base['ttfb_s']:.2f}, RSS x{r['peak_rss_mb'] / base['peak_rss_mb']:.2f} vs 1x"
            rows.append([label, mult, n, p["mb"], r.get("ttfb_s"), r.get("cold_ttfb_s"), r.get("init_s"),
                         r.get("peak_rss_mb"), r.get("baseline_rss_mb"), growth])
    table = bl.md_table(["system", "size", "records", "MB", "first row s (after init)", "first row s (from process start)",
                         "init s", "peak RSS MB (tree)", "RSS after init MB", "growth"], rows)
    load_rows = []
    for label, r in (b3.get("actor_start") or {}).items():
        if "error" in r:
            load_rows.append([label, NA, "-", "-", "-", "-", r["error"][:120]])
            continue
        load_rows.append([label, r["pipelines_import_s"], r["transformers_import_s"], r["from_pretrained_s"],
                          r["tokenizers_only_s"], "yes" if r["torch_imported"] else "no", ""])
    if load_rows:
        table += ("\n\nCold start of one tokenizer process (what each tokenizer actor pays before its first batch; "
                  "peers pay it once, before their clock starts):\n\n" + bl.md_table(
                      ["environment", "import pipelines.tokenize.stage s", "import transformers s", "AutoTokenizer.from_pretrained s",
                       "tokenizers.Tokenizer.from_file alone s", "torch imported", ""], load_rows))
    return table


# --------------------------------------------------------------------------- B5-B7 (external scripts)


def run_external(script: str, ctx: dict[str, Any], min_timeout: float = 0.0, args: tuple[str, ...] = ()) -> dict[str, Any]:
    path = bl.BENCH_DIR / script
    if not path.is_file():
        return {"status": NA, "why": f"benchmarks/{script} is not there yet"}
    cmd = [bl.PY, str(path)] + (["--quick"] if ctx["quick"] else []) + list(args)
    env = {**os.environ, **bl.CHILD_ENV, "PYTHONPATH": os.pathsep.join([str(bl.ROOT), str(bl.BENCH_DIR)])}
    timeout = max(ctx["external_timeout"], min_timeout)
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=bl.ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err_text = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        bl.kill_group(proc)  # the script's own children too (mds_read.py's moto server)
        proc.communicate()
        return {"status": NA, "why": f"benchmarks/{script} ran past {timeout:.0f} s"}
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        err = (err_text or out).strip().splitlines()
        if ctx["quick"] and proc.returncode == 2 and "unrecognized arguments" in err_text:
            return {"status": NA, "why": f"benchmarks/{script} has no --quick mode (not run in --quick)"}
        return {"status": NA, "why": f"benchmarks/{script} failed (exit {proc.returncode}): {' | '.join(err[-4:])[-400:]}"}
    lines = out.splitlines()
    parsed, text = [], []
    for ln in lines:
        tag = next((t for t in RESULT_TAGS if ln.startswith(t)), None)
        if tag:
            try:
                parsed.append(json.loads(ln[len(tag):]))
                continue
            except json.JSONDecodeError:
                pass
        if "(raylet)" not in ln:  # Ray's own warnings, forwarded to the driver: not results
            text.append(ln)
    return {"status": "ok", "wall_s": wall, "stdout": "\n".join(text), "results": parsed}


# B8's set step time: ranks that each spend this long on a step (a small model's step on a GPU), for B8_STEPS steps
# (quick: 50 ms, 20 steps).
B8_STEP_MS, B8_STEPS = 500, 200


def run_b8(ctx: dict[str, Any], plot: tuple[str, ...]) -> dict[str, Any]:
    """B8 twice: ranks that take rows as fast as they can (the feeder's capacity), then ranks at a set step
    time (what they wait for their rows). One section: both runs' results, the free-running one first."""
    free = run_external("feeder_scale.py", ctx, min_timeout=600, args=plot)  # quick: ~90 s alone
    paced = run_external("feeder_scale.py", ctx, min_timeout=900, args=(
        "--step-ms", str(50 if ctx["quick"] else B8_STEP_MS), "--steps", str(20 if ctx["quick"] else B8_STEPS)))
    runs = [r for r in (free, paced) if r.get("status") == "ok"]
    if not runs:
        return free
    return {"status": "ok", "wall_s": sum(r["wall_s"] for r in runs), "results": [x for r in runs for x in r["results"]],
            "stdout": "\n\n".join(r["stdout"] for r in runs) + "".join(
                f"\n\n{NA}: {r.get('why', '')}" for r in (free, paced) if r.get("status") != "ok")}


def external_md(r: dict[str, Any]) -> str:
    if r.get("status") != "ok":
        return f"{NA}: {r.get('why', '')}"
    text = r["stdout"].rstrip()
    table = [ln for ln in text.splitlines() if ln.lstrip().startswith("|")]
    other = [ln for ln in text.splitlines() if not ln.lstrip().startswith("|")][-40:]
    parts = []
    if table:
        parts.append("\n".join(table))
    if other:
        parts.append("```\n" + "\n".join(other) + "\n```")
    parts.append(f"(ran in {r['wall_s']:.0f} s)")
    return "\n\n".join(parts)


# --------------------------------------------------------------------------- plots


def make_plots(ctx: dict[str, Any], plot_dir: Path) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as err:
        print(f"  plots: {NA} (matplotlib: {err})")
        return []
    plot_dir.mkdir(parents=True, exist_ok=True)
    made = []
    for name, fn in (("b2_throughput.png", _plot_b2), ("b3_ttfb_rss.png", _plot_b3), ("b4_packing.png", _plot_b4),
                     ("b4_row_lengths.png", _plot_hist)):
        try:
            fig = fn(plt, ctx)
        except Exception as err:
            print(f"  plot {name}: {NA} ({type(err).__name__}: {err})")
            continue
        if fig is None:
            continue
        fig.savefig(plot_dir / name, dpi=110, bbox_inches="tight")
        plt.close(fig)
        made.append(name)
    return made


def _plot_b2(plt: Any, ctx: dict[str, Any]) -> Any:
    systems = [(label, r) for label, r in b2_systems(ctx) if "error" not in r]
    if not systems:
        return None
    fig, ax = plt.subplots(figsize=(9, 0.55 * len(systems) + 1.8))
    ys = range(len(systems))
    ax.barh([y + 0.2 for y in ys], [r["steady_tok_s"] / 1e6 for _, r in systems], height=0.4, label="steady state")
    ax.barh([y - 0.2 for y in ys], [r["e2e_tok_s"] / 1e6 for _, r in systems], height=0.4, label="end to end", alpha=0.6)
    ax.set_yticks(list(ys), [label for label, _ in systems], fontsize=8)
    ax.invert_yaxis()
    ing = ctx["ingest"]
    for key, style, text in (("raw 2t", "-", "B1 ceiling, 2 threads"), ("raw 1t", "--", "B1, 1 thread")):
        r = ing.get(key)
        if r and "error" not in r:
            ax.axvline(r["steady_tok_s"] / 1e6, color="k", linestyle=style, linewidth=1, label=text)
    if ing.get("raw 2t") and "error" not in ing["raw 2t"]:
        ax.axvline(0.85 * ing["raw 2t"]["steady_tok_s"] / 1e6, color="r", linestyle=":", linewidth=1,
                   label="target: 0.85x ceiling")
    ax.set_xlabel("M tokens/s (GPT-2, Alpaca, same cores)")
    ax.set_title(f"B2 ingest throughput, {ctx['records']} records, {ctx['cpus']} CPUs")
    ax.legend(fontsize=7, loc="lower right")
    return fig


def _plot_b3(plt: Any, ctx: dict[str, Any]) -> Any:
    b3 = ctx["results"].get("B3")
    if not b3 or "points" not in b3:
        return None
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    for key, label in B3_LABELS.items():
        xs, ttfb, cold, rss = [], [], [], []
        for n in b3["sizes"]:
            p = b3["points"][str(n)]
            r = p[key]
            if "error" in r:
                continue
            xs.append(p["mb"])
            ttfb.append(r["ttfb_s"])
            cold.append(r.get("cold_ttfb_s"))
            rss.append(r["peak_rss_mb"])
        if xs:
            line = a1.plot(xs, ttfb, marker="o", label=f"{label}, after init")[0]
            if all(c is not None for c in cold):
                a1.plot(xs, cold, marker="x", linestyle="--", color=line.get_color(), label=f"{label}, from process start")
            a2.plot(xs, rss, marker="o", label=label)
    from matplotlib.ticker import NullFormatter

    for ax, yl in ((a1, "time to first row, s"), (a2, "peak RSS of the process tree, MB")):
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("data size, MB (log)")
        ax.set_ylabel(yl)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("B3 time to first row and peak memory vs data size")
    return fig


def _plot_b4(plt: Any, ctx: dict[str, Any]) -> Any:
    b4 = ctx["results"].get("B4")
    if not b4 or not b4.get("rows"):
        return None
    combos = sorted({(r["dataset"], r["tokenizer"]) for r in b4["rows"]})
    fig, axes = plt.subplots(1, len(combos), figsize=(5 * len(combos), 4), squeeze=False)
    strategies = packing_bench.STRATEGIES
    width = 0.8 / len(strategies)
    for ax, (d, t) in zip(axes[0], combos, strict=True):
        for j, s in enumerate(strategies):
            pts = [(r["sequence_len"], r["efficiency"]) for r in b4["rows"]
                   if r["dataset"] == d and r["tokenizer"] == t and r["strategy"] == s]
            xs = [packing_bench.SEQ_LENS.index(x) + (j - (len(strategies) - 1) / 2) * width for x, _ in pts]
            ax.bar(xs, [100 * e for _, e in pts], width=width, label=s)
        ax.axhline(98, color="r", linestyle=":", linewidth=1)
        ax.set_xticks(range(len(packing_bench.SEQ_LENS)), [str(x) for x in packing_bench.SEQ_LENS])
        ax.set_ylim(85, 100.5)
        ax.set_xlabel("sequence_len")
        ax.set_ylabel("packing efficiency, %")
        ax.set_title(f"{d} / {t}", fontsize=9)
    axes[0][0].legend(fontsize=7, loc="lower left")
    fig.suptitle("B4 packing efficiency (red: 98% target)")
    return fig


def _plot_hist(plt: Any, ctx: dict[str, Any]) -> Any:
    b4 = (ctx["results"].get("B4") or {}).get("rows") or []
    pick = [r for r in b4 if r["dataset"] == "alpaca_en_demo" and r["tokenizer"] == "gpt2" and r["sequence_len"] == 2048
            and r["strategy"] in (packing_bench.BFD_DEFAULT, packing_bench.GREEDY, packing_bench.BFD_SMALL)]
    ours = (ctx["ingest"].get("ours") or {}).get("row_lengths")
    if not pick and not ours:
        return None
    fig, ax = plt.subplots(figsize=(8, 4))
    bins = range(0, 2048 + 65, 64)
    if ours:
        ax.hist(ours, bins=bins, alpha=0.5, density=True, label=f"build_dataset rows (B2, {len(ours)} rows)")
    for r in pick:
        ax.hist(r["row_lengths"], bins=bins, histtype="step", density=True, linewidth=1.5,
                label=f"{r['strategy']} (B4, {r['rows']} rows)")
    ax.set_xlabel("packed row length, tokens (sequence_len 2048, GPT-2, Alpaca)")
    ax.set_ylabel("share of rows (density)")
    ax.legend(fontsize=7, loc="upper left")
    ax.set_title("Packed-row length histogram")
    return fig


# --------------------------------------------------------------------------- targets + report


def target_rows(ctx: dict[str, Any]) -> list[list[str]]:
    ing, res = ctx["ingest"], ctx["results"]
    rows = []
    ours = ing.get("ours") or {}
    best = ing.get("ours_best")
    ours_best = ing.get("ours_sweep", {}).get(best) if best else None
    ceiling = ing.get("raw 2t")
    peer_label, peer = best_peer(ctx)

    def status(v: float | None, ok: bool) -> str:
        return NA if v is None else ("met" if ok else "MISSED")

    pools = [("default config", ours)] + ([(f"best setting: {best}", ours_best)] if best and best != "default" else [])
    for tag, r in pools:
        if not r or "error" in r:
            rows.append(["B2", f"ours ({tag}) >= 1.0x best peer, >= 0.85x B1", NA, NA])
            continue
        b = ingest.burst(r, ceiling)
        for what, other, target in ((f"best peer ({peer_label})", peer, 1.0),
                                    ("HF streaming (issue 2)", ing.get("hf_stream"), 1.0),
                                    ("B1 ceiling at 2 threads (issue 10)", ceiling, 0.85)):
            st, e2e = ingest.ratio(r, other), ingest.ratio(r, other, "e2e_tok_s")
            text = f"steady {st:.2f}x{' (burst)' if b else ''}, end to end {e2e:.2f}x" if st and e2e else NA
            ok = bool(st and st >= target) and not b
            rows.append(["B2", f"ours ({tag}) steady >= {target}x {what}", text,
                         "burst: see end to end" if b and st else status(st, ok)])
        if tag == "default config":
            cpu, hf = r.get("cpu_s_per_mtok"), (ing.get("hf_stream") or {}).get("cpu_s_per_mtok")
            rows.append(["B2", "ours CPU-s per M tokens (whole process tree) <= HF streaming's (issue 10)",
                         f"{cpu:.2f} vs {hf:.2f} ({cpu / hf:.2f}x)" if cpu and hf else NA,
                         status(hf, bool(cpu and hf and cpu <= hf))])
            t = r.get("ttfb_s")
            rows.append(["B2", "first packed row <= ray.init + 2 s (issue 2)",
                         f"{t:.2f} s after ray.init ({r.get('init_s', 0):.2f} s)" if t is not None else NA,
                         status(t, t is not None and t <= 2.0)])
    b3 = res.get("B3")
    if b3 and "points" in b3:
        s = b3["sizes"]
        a, z = b3["points"][str(s[0])]["ours"], b3["points"][str(s[-1])]["ours"]
        if "error" not in a and "error" not in z:
            gt, gr = z["ttfb_s"] / a["ttfb_s"], z["peak_rss_mb"] / a["peak_rss_mb"]
            rows.append(["B3", "ours flat in data size: 16x <= 1.2x of 1x (first row, peak RSS)",
                         f"first row x{gt:.2f}, peak RSS x{gr:.2f}", "met" if gt <= 1.2 and gr <= 1.2 else "MISSED"])
        e1, e16 = b3["points"][str(s[0])]["eager"], b3["points"][str(s[-1])]["eager"]
        if "error" not in e1 and "error" not in e16:
            rows.append(["B3", "eager path grows with data (reference)",
                         f"first row x{e16['ttfb_s'] / e1['ttfb_s']:.2f}, peak RSS x{e16['peak_rss_mb'] / e1['peak_rss_mb']:.2f}",
                         "-"])
    b4 = (res.get("B4") or {}).get("rows") or []
    for seq in packing_bench.SEQ_LENS:
        sel = {r["strategy"]: r for r in b4 if r["dataset"] == "alpaca_en_demo" and r["tokenizer"] == "gpt2"
               and r["sequence_len"] == seq}
        bfd, ffd = sel.get(packing_bench.BFD_DEFAULT), sel.get(packing_bench.FFD)
        if bfd and ffd:
            gap = 100 * (ffd["efficiency"] - bfd["efficiency"])
            ok = bfd["efficiency"] >= 0.98 and bfd["split_share"] == 0 and gap <= 1.0
            rows.append(["B4", f"bfd >= 98%, 0 split, within 1 pt of whole-dataset FFD (Alpaca, GPT-2, seq {seq})",
                         f"{100 * bfd['efficiency']:.2f}% (FFD {100 * ffd['efficiency']:.2f}%, gap {gap:.2f} pt)",
                         "met" if ok else "MISSED"])
    rows += _b5_rows(res.get("B5") or {})
    rows += _ratio_rows(res.get("B6") or {}, "B6", [
        ("read_local_ratio", "MDS read, local disk >= 1.0x mosaic StreamingDataset (tokens/s)", 1.0, True),
        ("read_s3_ratio", "MDS read, loopback S3 >= 1.0x mosaic StreamingDataset (tokens/s)", 1.0, True),
        ("read_tok_local_ratio", "pre-tokenized MDS read, local disk >= 1.0x mosaic StreamingDataset (tokens/s)", 1.0,
         True),
        ("read_tok_s3_ratio", "pre-tokenized MDS read, loopback S3 >= 1.0x mosaic StreamingDataset (tokens/s)", 1.0,
         True),
        ("convert_ratio", "convert.py --tokenize >= 1.0x the better of mosaic's parallel conversion (Pool(2) + "
         "merge_index) and a 2-thread tokenize + MDSWriter loop (rows/s, after Ray start-up)", 1.0, True)])
    rows += _ratio_rows(res.get("B7") or {}, "B7", [("ratio_90_10", "resume at 90% <= 1.2x at 10%", 1.2, False)])
    rows += _b8_rows(res.get("B8") or {})
    return rows


def _b8_rows(r: dict[str, Any]) -> list[list[str]]:
    """B8 targets from feeder_scale.py's RESULT line (keys: largest_n, largest_n_ratio, max_cpu_s_per_m_tokens)."""
    targets = ["feeder tokens/s at the largest N >= 0.8x one ds.iter_batches() consumer",
               "feeder CPU-s per M tokens <= 0.05 at every N"]
    free = [x for x in r.get("results") or [] if "largest_n_ratio" in x]  # not the set-step-time run (run_b8)
    last = free[-1] if free and r.get("status") == "ok" else {}
    ratio, cpu = last.get("largest_n_ratio"), last.get("max_cpu_s_per_m_tokens")
    if not isinstance(ratio, (int, float)) or not isinstance(cpu, (int, float)):
        return [["B8", t, NA, NA] for t in targets]
    rows = [["B8", targets[0] + f" (N={last.get('largest_n')})", f"{ratio:.2f}x", "met" if ratio >= 0.8 else "MISSED"],
            ["B8", targets[1], f"{cpu:.4f}", "met" if cpu <= 0.05 else "MISSED"]]
    for n, split in (last.get("split_ratio") or {}).items():  # issue 43: Ray Data's own per-rank path as the peer
        rows.append(["B8", f"feeder tokens/s >= 1.0x ds.streaming_split(N) (N={n})", f"{split:.2f}x",
                     "met" if split >= 1.0 else "MISSED"])
    return rows


def _ratio_rows(r: dict[str, Any], key: str, specs: list[tuple[str, str, float, bool]]) -> list[list[str]]:
    """Target rows from an external script's RESULT line: (field, target, bound, higher_is_better)."""
    last = (r.get("results") or [{}])[-1] if r.get("status") == "ok" else {}
    rows = []
    for field, target, bound, higher in specs:
        value = last.get(field)
        if not isinstance(value, (int, float)):
            rows.append([key, target, NA if r.get("status") != "ok" else "see section", NA])
            continue
        ok = value >= bound if higher else value <= bound
        rows.append([key, target, f"{value:.2f}x", "met" if ok else "MISSED"])
    return rows


def _b5_rows(r: dict[str, Any]) -> list[list[str]]:
    """B5 targets from train_stall.py's RESULT line (keys: build_dataset.data_wait_pct, ratio)."""
    target = "data wait < 5% of step time, >= 0.95x synthetic steps/s"
    if r.get("status") != "ok":
        return [["B5", target, NA, NA]]
    try:
        last = r["results"][-1]
        wait, ratio = float(last["build_dataset"]["data_wait_pct"]), float(last["ratio"])
    except (IndexError, KeyError, TypeError, ValueError):
        return [["B5", target, "see section", "see section"]]
    return [["B5", "data wait < 5% of step time", f"{wait:.2f}%", "met" if wait < 5 else "MISSED"],
            ["B5", ">= 0.95x synthetic steps/s", f"{ratio:.3f}x", "met" if ratio >= 0.95 else "MISSED"]]


def notes(ctx: dict[str, Any]) -> list[str]:
    """Known causes behind the numbers, filled in from this run (hand-written analysis: docs/benchmark_analysis.md)."""
    ours = ctx["ingest"].get("ours") or {}
    if not ours or "error" in ours:
        return []
    out = ["Notes from this run:", ""]
    if ours.get("ttfb_s") is not None:
        out.append(f"- ours' first row came {ours['ttfb_s']:.2f} s after `ray.init` ({ours['init_s']:.2f} s). It needs the "
                   "process that tokenizes started (on 2 CPUs the read task itself, `data.tokenize.placement: auto`; "
                   "elsewhere a tokenizer actor: a worker process that imports `ray.data` and the pipeline, then loads the "
                   "tokenizer: the Rust one for these Alpaca records; Ray Data's own share: docs/benchmark_history.md, \"Ray Data's "
                   "first-block floor\") and "
                   "the stream's first unit (256 kB of records, `FIRST_UNIT_BYTES`; a read task of its own) read, "
                   "tokenized and packed. The consumer iterates with `prefetch_batches=0`, as the feeder reads blocks as they "
                   "come; Ray's prefetching window with `batch_size=None` would hold each block until the next one arrives. Ray Data's per-operator times of each run are in results.json (`ray_data_stats`); "
                   "the arrival times of the batches are in `timeline`.")
    if ours.get("baseline_rss_mb"):
        out.append(f"- ours' peak RSS counts the whole Ray tree: {ours['baseline_rss_mb']:.0f} MB of it is there right after "
                   "`ray.init`, before any data (GCS, raylet, agents, idle workers); see `RSS after init` in B3.")
    if ingest.burst(ours, ctx["ingest"].get("raw 2t")):
        out.append("- ours' steady rate after the first row is above the tokenizer's own ceiling: the rows came in a "
                   "burst after a late first row, so it is not a steady state; compare the end-to-end rate.")
    return out + [""]


def write_report(ctx: dict[str, Any], out_md: Path, plots: list[str], plot_rel: str) -> None:
    res, ing = ctx["results"], ctx["ingest"]
    d = ing.get("_data", {})
    m, v = ctx["machine"], bl.versions()
    mode = "--quick (tiny data, 1 repeat: smoke test, not for quoting)" if ctx["quick"] else "full"
    lines = [
        "# Benchmarks",
        "",
        *(["> DRAFT from `--quick` (tiny data, one repeat, possibly a busy machine): a smoke test of the tables, "
           f"not numbers to quote. The real ones come from `{FULL_CMD}` on a quiet machine.", ""] if ctx["quick"] else []),
        f"Produced by: `{ctx['command']}` ({mode}); the numbers below are from that one run.",
        f"Full run: `{FULL_CMD}` (rewrites everything above the kept sections of this file, "
        "`benchmarks/results/*.png` and `results.json`). Smoke test: `.venv/bin/python benchmarks/run.py --quick` "
        "(< 3 min, writes to a temp dir). Issue 2's stand-alone ingest table: `.venv/bin/python benchmarks/ingest.py`.",
        "",
        "The gaps, their measured bounds and what would remove them are written by hand in "
        "[docs/benchmark_analysis.md](docs/benchmark_analysis.md), which no run rewrites; earlier runs' notes are in "
        "[docs/benchmark_history.md](docs/benchmark_history.md).",
        "",
        f"- date: {ctx['started']} (run took {ctx['elapsed'] / 60:.1f} min)",
        f"- commit: {ctx['git']['commit']}" + (f" with uncommitted changes to {', '.join(ctx['git']['dirty'])}"
                                               if ctx["git"]["dirty"] else " (clean)"),
        f"- machine: {m['cpus']} CPUs ({m['cpus_usable']} usable; {m['cpu_model']}), {m['memory_gib']} GiB RAM, "
        f"{m['platform']}, Python {m['python']}; load average at start {m['load_avg']}, at end {ctx['load_end']}",
        f"- every system gets the same {ctx['cpus']} CPUs (Ray: `num_cpus={ctx['cpus']}`; peers: 2 workers / processes / threads)",
        "- versions: " + ", ".join(f"{k} {val}" for k, val in v.items()),
        f"- data (B1-B3): the real Alpaca demo (`../shared/data/sft/alpaca_en_demo.json`, 999 records, 0.86 MB) "
        f"replicated to {d.get('records')} records = {d.get('bytes', 0) / 1e6:.1f} MB, as {d.get('files')} "
        "JSONL shards of one copy each; every system formats records with the same Alpaca prompt "
        "(`pipelines.sources.formats`) + EOS. B4: the Alpaca demo and LIMA as they are.",
        "- tokenizers: GPT-2 (`../shared/data/tokenizers/gpt2`) everywhere; SmolLM2-135M-Instruct too in B4",
        f"- repeats: median of {ctx['repeats']} runs per system (each run a fresh process; B1: median of passes); "
        "pool-sweep settings other than the default and the best: 1 run each",
        "- timing: `init` = framework start-up (`ray.init`); `first row (after init)` = from the start of data work to the "
        "first (packed) row in the consumer's hands (peers have loaded their tokenizer before it; ours loads it in the "
        "process that tokenizes, after it); `first row (from process start)` = the same from the launch of the process, "
        "imports, tokenizer loading and init included (the fair cold-start comparison); steady state = tokens after the first batch / time after it; "
        "peak RSS = summed RSS of the whole process tree (Ray's GCS, raylet and workers included; shared pages "
        "count once per process, so it is an upper bound and is large for Ray)",
        "- peers do less work than ours: no label masks, and no packing except the eager path, so ratios in our "
        "favour are conservative",
        "- CPU s / M tok: user+system CPU of the whole process tree (start-up included) per million tokens "
        "delivered; less sensitive to other load on the machine than wall-clock rates",
        "",
        "## At a glance: ours against the best variant of each peer, this run",
        "",
        "Medians of this run's repeats (B8: one run per N). Start-up is the first batch or row from the "
        "clock's start (frameworks' own init excluded: `init` in the sections below); steady is the rate after it. "
        "Ratios above 1 are ours ahead.",
        "",
        headline_md(ctx),
        "",
        "## Targets",
        "",
        bl.md_table(["id", "target", "measured", "status"], target_rows(ctx)),
        "",
        "A MISSED target keeps its number here; its bound and cause are in docs/benchmark_analysis.md.",
        "",
        *notes(ctx),
        "## B1 tokenizer ceiling: `encode_batch_fast` alone (ids without offsets, the call ours makes for byte-level BPE)",
        "",
        b1_md(res.get("B1") or {}),
        "",
        "## B2 ingest: read -> format -> tokenize -> pack -> rows (consumer does nothing)",
        "",
        b2_md(ctx) if "B2" in res else f"{NA}: {res.get('B2_error', '')}",
        "",
        f"### Tokenizer stage settings for `build_dataset` (default: {ingest.describe_default_pool(ctx['cpus'])})",
        "",
        sweep_md(ctx),
        "",
        "## B3 time to first row and peak RSS vs data size",
        "",
        b3_md(res["B3"]) if "B3" in res and "sizes" in res["B3"] else f"{NA}: {res.get('B3_error', '')}",
        "",
        "## B4 packing efficiency, truncated / dropped / split samples",
        "",
        "Strategies: " + "; ".join(packing_bench.STRATEGIES) + ". Efficiency = tokens in rows / (rows x sequence_len). "
        "`truncated`: samples longer than sequence_len, cut (default `oversize: truncate`); `dropped`: left without "
        "trained tokens after the cut; `split`: samples spread over more than one row (concat only).",
        "",
    ]
    b4 = res.get("B4") or {}
    for dname in sorted({r["dataset"] for r in b4.get("rows", [])}):
        lines += [f"### {dname}", "", bl.md_table(*packing_bench.b4_table(b4, dname)), ""]
    lines += [f"- {e}" for e in b4.get("errors", [])] + ([""] if b4.get("errors") else [])
    if not b4.get("rows"):
        lines += [f"{NA}: {res.get('B4_error', '')}", ""]
    for key, title in (("B5", "B5 data-wait fraction while training (`benchmarks/train_stall.py`)"),
                       ("B6", "B6 MDS read (`benchmarks/mds_read.py`)"),
                       ("B7", "B7 resume latency (`benchmarks/resume.py`)"),
                       ("B8", "B8 feeder scale: N simulated ranks (`benchmarks/feeder_scale.py`)")):
        lines += [f"## {title}", "", external_md(res.get(key) or {"why": "not run (--only / --skip)"}), ""]
    lines += ["## Plots", ""]
    lines += [f"![{p}]({plot_rel}/{p})" for p in plots] or [f"{NA} (matplotlib missing)"]
    lines.append("")
    out_md.write_text("\n".join(lines) + "\n" + KEPT_MARKER + kept_sections(out_md), encoding="utf-8")


# Sections measured by other scripts (LoRA, the default job, the GPU check) sit below this line in
# BENCHMARKS.md; a full run rewrites everything above it and keeps them as they are.
KEPT_MARKER = "<!-- Sections below this line are measured by their own commands; benchmarks/run.py keeps them. -->"


def kept_sections(md: Path) -> str:
    """What follows the marker in the existing ``md`` (a newline when there is no such file or marker)."""
    text = md.read_text(encoding="utf-8") if md.is_file() else ""
    at = text.find(KEPT_MARKER)
    return "\n" if at < 0 else text[at + len(KEPT_MARKER):]


# --------------------------------------------------------------------------- main


def _strip(obj: Any) -> Any:
    """results.json without the long per-row length lists."""
    if isinstance(obj, dict):
        return {k: _strip(v) for k, v in obj.items() if k not in ("row_lengths",)}
    if isinstance(obj, list):
        return [_strip(x) for x in obj]
    return obj


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Run B1-B7 and write BENCHMARKS.md + plots")
    ap.add_argument("--quick", action="store_true", help="tiny data, 1 repeat, < 3 min; writes to a temp dir unless --out")
    ap.add_argument("--out", type=Path, help="write BENCHMARKS.md, results/*.png and results.json here instead")
    ap.add_argument("--repeats", type=int, help="runs per system (default 3, quick 1)")
    ap.add_argument("--records", type=int, help=f"B2 data size in records (default {ingest.FULL_RECORDS}, quick 999)")
    ap.add_argument("--cpus", type=int, default=min(2, os.cpu_count() or 2), help="CPUs per system (default 2)")
    ap.add_argument("--work", type=Path, help="data/cache dir (default benchmarks/.work; quick: inside --out)")
    ap.add_argument("--no-sweep", action="store_true", help="only the default tokenizer pool in B2")
    ap.add_argument("--only", default="B1,B2,B3,B4,B5,B6,B7,B8", help="comma-separated subset (B1 and B2 share the ingest run)")
    ap.add_argument("--skip", default="", help="comma-separated benchmarks not to run, e.g. B5,B6 (reported as not run)")
    ap.add_argument("--external-timeout", type=float, help="seconds for each of B5-B8's scripts (default 1200, quick 150; full B6 at least 4200, B8 600 and 900 for its set-step-time run)")
    args = ap.parse_args(argv)

    t_start = time.perf_counter()
    if args.out:
        out_dir = args.out.resolve()
    elif args.quick:
        out_dir = Path(tempfile.mkdtemp(prefix="bench-quick-"))
    else:
        out_dir = bl.ROOT
    if out_dir == bl.ROOT:  # the repository's own BENCHMARKS.md and benchmarks/results/
        out_md, plot_dir, plot_rel = bl.ROOT / "BENCHMARKS.md", bl.BENCH_DIR / "results", "benchmarks/results"
        work = args.work or bl.DEFAULT_WORK
    else:
        out_md, plot_dir, plot_rel = out_dir / "BENCHMARKS.md", out_dir / "results", "results"
        work = args.work or out_dir / ".work"
    out_dir.mkdir(parents=True, exist_ok=True)
    only = {x.strip().upper() for x in args.only.split(",")} - {x.strip().upper() for x in args.skip.split(",")}
    ctx: dict[str, Any] = {
        "quick": args.quick, "cpus": args.cpus, "work": work, "logs": work / "logs",
        "repeats": args.repeats or (1 if args.quick else 3),
        "records": args.records or (999 if args.quick else ingest.FULL_RECORDS),
        "external_timeout": args.external_timeout or (150 if args.quick else 1200),
        "machine": bl.machine_info(), "git": bl.git_state(), "started": dt.datetime.now().isoformat(timespec="seconds"),
        "command": " ".join([".venv/bin/python", "benchmarks/run.py", *(argv if argv is not None else sys.argv[1:])]),
        "results": {}, "ingest": {},
    }
    res = ctx["results"]
    print(f"benchmarks: {'quick' if args.quick else 'full'}, {ctx['records']} records, {ctx['cpus']} CPUs, "
          f"{ctx['repeats']} repeat(s); output {out_md}", flush=True)

    def section(key: str, fn: Any) -> None:
        if key not in only:
            return
        t0 = time.perf_counter()
        print(f"{key} ...", flush=True)
        try:
            res[key] = fn(ctx)
        except Exception as err:
            traceback.print_exc()
            res[f"{key}_error"] = f"{type(err).__name__}: {err}"
        print(f"{key} done in {time.perf_counter() - t0:.0f} s", flush=True)

    if not bl.shared_available():
        print(f"{NA}: real data not found under {bl.SHARED}; B1-B4 skipped")
        only -= {"B1", "B2", "B3", "B4"}
    if only & {"B1", "B2", "B3"}:
        only.add("ingest")

        def _ingest(c: dict[str, Any]) -> dict[str, Any]:
            sweep = ["default"] if args.no_sweep or "B2" not in only else (
                ingest.QUICK_POOL_SETTINGS[:1] if args.quick else list(ingest.POOL_SETTINGS))
            c["ingest"] = ingest.run_ingest(work, c["records"], c["repeats"], c["cpus"], sweep, c["logs"],
                                            with_local=not args.quick)
            return {"ok": True}
        section("ingest", _ingest)
        if "B1" in only:
            section("B1", run_b1)
        if "B2" in only:
            section("B2", run_b2)
        if "B3" in only:
            section("B3", run_b3)
    section("B4", lambda c: packing_bench.run_b4(quick=c["quick"]))
    section("B5", lambda c: run_external("train_stall.py", c))
    # Full B6 takes ~50 min: its conversion case converts 200 MB five times each way (~21 min), and its pre-tokenized
    # case reads 501 M tokens five times in each of four local systems (~21 min).
    section("B6", lambda c: run_external("mds_read.py", c, min_timeout=0 if c["quick"] else 4200))
    section("B7", lambda c: run_external("resume.py", c))
    b8_plot = () if args.quick else ("--plot", str(plot_dir / "feeder_scale.png"))  # --out: not the repository's
    section("B8", lambda c: run_b8(c, b8_plot))

    ctx["elapsed"] = time.perf_counter() - t_start
    ctx["load_end"] = [round(x, 2) for x in os.getloadavg()]
    plots = make_plots(ctx, plot_dir)
    write_report(ctx, out_md, plots, plot_rel)
    results_json = (plot_dir / "results.json")
    res.pop("ingest", None)  # the section's status; the ingest results themselves are ctx["ingest"]
    results_json.write_text(json.dumps(_strip({"machine": ctx["machine"], "git": ctx["git"], "versions": bl.versions(), **res,
                                                "ingest": ctx["ingest"]}), indent=1, default=str))
    print(f"\nwrote {out_md}, {len(plots)} plots and results.json under {plot_dir} "
          f"in {(time.perf_counter() - t_start) / 60:.1f} min\n")
    print(out_md.read_text(encoding="utf-8"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
