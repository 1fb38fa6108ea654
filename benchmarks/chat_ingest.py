"""Chat ingest (issue 40): the tokenizer stage on chat records with tool calls and reasoning, per token.

Run (full: 5 runs per checkout; ``--quick``: 1 run on a tenth of the data)::

    git worktree add /tmp/old e52e0a4          # the code before the chat_template rewrite
    .venv/bin/python benchmarks/chat_ingest.py --root /tmp/old --root . [--runs 5] [--quick]

Without ``--root`` it measures the checkout it lives in. With several roots, each run is a fresh child
process of one root (``PYTHONPATH=<root>``, ``cwd=<root>``, so it imports that root's ``pipelines``), and
the roots take turns: old, new, old, new, ... The first root is the baseline of the ratio column.

What is timed, in-process and without Ray (as ``tests/test_chat_labels.py``'s ``_tokenize``): the
``Tokenizer`` stage (``pipelines.tokenize.stage.Tokenizer``, JSON parse + chat formatting + encoding + labels)
over every block of the case, ``tok(block)`` per block. Outside the clock: loading the tokenizer, reading
the files into blocks (``pipelines.sources.read.read_files``), and a warm-up pass of a separate
``Tokenizer`` over the first 64 records (the chat template's compilation and other first-use costs).
The Rust tokenizer runs on one thread in every run (``RAYON_NUM_THREADS=1``,
``TOKENIZERS_PARALLELISM=false`` in the child's environment, ``data.tokenize.threads: 1``).

Cases (JSONL under ``benchmarks/.work/chat_ingest/``, git-ignored):

* ``glaive``: the real Glaive tool-call demo (``../shared/data/chat/glaive_toolcall_en_demo.json``, 300
  ShareGPT conversations with ``function_call``/``observation`` turns and a ``tools`` JSON column),
  repeated 10x (3,000 records);
* ``agentic``: 3,000 generated OpenAI-format conversations (:func:`agentic_records`): tool definitions,
  2-4 tool calls each (one per assistant turn, or all in one turn), tool results, and
  ``reasoning_content`` on the first and the last assistant turn.

Tokenizer: SmolLM2-135M-Instruct's (ChatML). ``data.on_bad_record: skip`` for every root; skipped records
(``skipped_bad_record``) are reported per root.

The metric is per token (``len(input_ids)`` summed over the output rows): the code before the rewrite
(e52e0a4) renders tool calls of ShareGPT data as plain assistant text and drops ``tool_calls`` and
``reasoning_content`` of OpenAI messages, so the two checkouts produce different token counts for the
same records.

Printed: a markdown table (median and min-max of tokens/s, records/s, and tokens per CPU-second of the child
process: the stage runs two threads, formatting and encoding, so on a shared host CPU time varies less than
wall time) and a line ``RESULT {json}`` with every run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import benchlib as bl  # noqa: E402

ROOT, SMOLLM2 = bl.ROOT, bl.SMOLLM2
GLAIVE = bl.SHARED / "chat" / "glaive_toolcall_en_demo.json"
WORK = bl.DEFAULT_WORK / "chat_ingest"
FULL_RECORDS = 3000
QUICK_RECORDS = 300
WARM_RECORDS = 64
RESULT_TAG = "RESULT "
CHILD_TAG = "CHAT_INGEST "
# The Rust tokenizer's threads, fixed for every root (as pipelines.tokenize.stage.rust_thread_env(1) sets them).
THREAD_ENV = {"RAYON_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}

# --------------------------------------------------------------------------- data

CITIES = ["Paris", "Tokyo", "Lagos", "Lima", "Oslo", "Hanoi", "Denver", "Cairo", "Perth", "Quito", "Porto",
          "Seoul", "Dakar", "Austin", "Krakow", "Nairobi", "Montreal", "Bergen", "Valparaiso", "Chiang Mai"]
CUISINES = ["Thai", "Peruvian", "Ethiopian", "Georgian", "Basque", "Sichuan", "Lebanese", "Oaxacan"]
CURRENCIES = ["EUR", "USD", "JPY", "NGN", "PEN", "NOK", "VND", "EGP", "AUD", "KRW"]
CONDITIONS = ["sunny", "light rain", "overcast", "snow showers", "thunderstorms", "fog", "clear skies", "windy"]


def _tool(name: str, description: str, props: dict[str, tuple[str, str]], required: list[str]) -> dict[str, Any]:
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "required": required,
                       "properties": {k: {"type": t, "description": d} for k, (t, d) in props.items()}}}}


TOOLS = [
    _tool("get_weather", "Get the weather forecast for a city on a date",
          {"city": ("string", "City name"), "date": ("string", "ISO date, YYYY-MM-DD"),
           "unit": ("string", "celsius or fahrenheit")}, ["city", "date"]),
    _tool("search_flights", "Search direct and one-stop flights between two cities",
          {"origin": ("string", "Departure city"), "destination": ("string", "Arrival city"),
           "date": ("string", "ISO date"), "max_stops": ("integer", "0 or 1")}, ["origin", "destination", "date"]),
    _tool("convert_currency", "Convert an amount between two currencies at today's rate",
          {"amount": ("number", "Amount to convert"), "from": ("string", "ISO 4217 code"),
           "to": ("string", "ISO 4217 code")}, ["amount", "from", "to"]),
    _tool("find_restaurants", "Find restaurants in a city by cuisine, with rating and price level",
          {"city": ("string", "City name"), "cuisine": ("string", "Cuisine"),
           "open_now": ("boolean", "Only places open now")}, ["city", "cuisine"]),
    _tool("get_local_time", "Get the local time and UTC offset of a city",
          {"city": ("string", "City name")}, ["city"]),
]


def _date(i: int, k: int = 0) -> str:
    day = (i * 7 + k * 3) % 365
    month, dom = 1 + day // 31 % 12, 1 + day % 28
    return f"2025-{month:02d}-{dom:02d}"


def _call(i: int, j: int) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """The ``j``-th tool call of record ``i``: (tool name, arguments, result)."""
    city, other = CITIES[(i + j) % len(CITIES)], CITIES[(i * 3 + j + 7) % len(CITIES)]
    name = TOOLS[(i + j * 2) % len(TOOLS)]["function"]["name"]
    if name == "get_weather":
        args = {"city": city, "date": _date(i, j), "unit": "celsius" if (i + j) % 3 else "fahrenheit"}
        result = {"city": city, "date": args["date"], "high": 8 + (i * 5 + j) % 25, "low": (i * 3 + j) % 12,
                  "condition": CONDITIONS[(i + j) % len(CONDITIONS)], "precipitation_mm": (i * j) % 14}
    elif name == "search_flights":
        args = {"origin": city, "destination": other, "date": _date(i, j + 1), "max_stops": (i + j) % 2}
        result = {"flights": [{"flight": f"{city[:2].upper()}{100 + (i * 7 + k) % 900}",
                               "depart": f"{6 + (i + 3 * k) % 14:02d}:{(i * 11 + k * 17) % 60:02d}",
                               "stops": (i + k) % 2, "price_usd": 120 + (i * 37 + k * 53) % 800}
                              for k in range(1 + (i + j) % 3)]}
    elif name == "convert_currency":
        args = {"amount": 50 + (i * 13 + j) % 950, "from": CURRENCIES[(i + j) % len(CURRENCIES)],
                "to": CURRENCIES[(i + j + 3) % len(CURRENCIES)]}
        rate = round(0.01 + ((i * 17 + j * 5) % 2000) / 97, 4)
        result = {"amount": args["amount"], "from": args["from"], "to": args["to"], "rate": rate,
                  "converted": round(args["amount"] * rate, 2)}
    elif name == "find_restaurants":
        cuisine = CUISINES[(i + j) % len(CUISINES)]
        args = {"city": city, "cuisine": cuisine, "open_now": bool((i + j) % 2)}
        result = {"results": [{"name": f"{cuisine} House {(i + k) % 40}", "rating": round(3.5 + ((i + k) % 15) / 10, 1),
                               "price": "$" * (1 + (i + k) % 3), "distance_km": round(0.3 + ((i * k) % 50) / 10, 1)}
                              for k in range(2 + (i + j) % 2)]}
    else:
        args = {"city": city}
        result = {"city": city, "local_time": f"{(i * 5 + j) % 24:02d}:{(i * 7) % 60:02d}",
                  "utc_offset": f"{'+' if (i + j) % 3 else '-'}{(i + j) % 12:02d}:00"}
    return name, args, result


def _summary(name: str, args: dict[str, Any], result: dict[str, Any]) -> str:
    if name == "get_weather":
        return (f"In {args['city']} on {args['date']} expect {result['condition']}, a high of {result['high']} "
                f"and a low of {result['low']} degrees {args['unit']}, with {result['precipitation_mm']} mm of rain.")
    if name == "search_flights":
        best = min(result["flights"], key=lambda f: f["price_usd"])
        return (f"There are {len(result['flights'])} flights from {args['origin']} to {args['destination']} on "
                f"{args['date']}; the cheapest is {best['flight']} at {best['depart']} for ${best['price_usd']}.")
    if name == "convert_currency":
        return f"{args['amount']} {args['from']} is {result['converted']} {args['to']} at a rate of {result['rate']}."
    if name == "find_restaurants":
        top = max(result["results"], key=lambda r: r["rating"])
        return (f"The best rated {args['cuisine']} place in {args['city']} is {top['name']} ({top['rating']}, "
                f"{top['price']}, {top['distance_km']} km away).")
    return f"It is {result['local_time']} in {args['city']} (UTC{result['utc_offset']})."


def agentic_record(i: int) -> dict[str, Any]:
    """Conversation ``i`` of the generated agentic set (deterministic): OpenAI messages with ``tools``, 2-4 tool
    calls (even ``i``: one call per assistant turn; odd: all calls in one turn), a tool result per call, and
    ``reasoning_content`` on the first and last assistant turns."""
    n_calls = 2 + i % 3
    calls = [_call(i, j) for j in range(n_calls)]
    asks = ", then ".join(f"{n.replace('_', ' ')} for {', '.join(v if isinstance(v, str) else json.dumps(v) for v in a.values())}" for n, a, _ in calls)
    msgs: list[dict[str, Any]] = []
    if i % 4 != 3:
        msgs.append({"role": "system", "content": f"You are a travel assistant. Today is {_date(i)}. Use the tools "
                                                  "when you need live data and answer concisely."})
    msgs.append({"role": "user", "content": f"Request #{i}: I am planning a trip. Please {asks}."})
    tool_calls = [{"id": f"call_{i:05d}_{j}", "type": "function",
                   "function": {"name": n, "arguments": json.dumps(a)}} for j, (n, a, _) in enumerate(calls)]
    results = [{"role": "tool", "tool_call_id": f"call_{i:05d}_{j}", "name": n, "content": json.dumps(r)}
               for j, (n, _, r) in enumerate(calls)]
    first_reasoning = (f"The user asked for {n_calls} things. I should call {', '.join(n for n, _, _ in calls)} "
                       f"{'one after another' if i % 2 == 0 else 'in parallel'} and then summarise the results. "
                       f"The first city is {calls[0][1].get('city', calls[0][1].get('origin', 'unknown'))}.")
    preamble = "Let me look that up." if i % 5 == 0 else ""
    if i % 2 == 0:
        for j in range(n_calls):
            turn: dict[str, Any] = {"role": "assistant", "content": preamble if j == 0 else "", "tool_calls": [tool_calls[j]]}
            if j == 0:
                turn["reasoning_content"] = first_reasoning
            msgs += [turn, results[j]]
    else:
        msgs.append({"role": "assistant", "content": preamble, "reasoning_content": first_reasoning,
                     "tool_calls": tool_calls})
        msgs += results
    answer = " ".join(_summary(n, a, r) for n, a, r in calls)
    msgs.append({"role": "assistant", "content": f"Here is what I found. {answer} Anything else for request #{i}?",
                 "reasoning_content": f"All {n_calls} tool results are in; none failed. I will list them in the order "
                                      "the user asked, with the numbers as the tools returned them."})
    offered = [TOOLS[(i + k) % len(TOOLS)] for k in range(3)]  # three tools, plus any called tool not among them
    offered += [t for t in TOOLS if t not in offered and t["function"]["name"] in {n for n, _, _ in calls}]
    return {"messages": msgs, "tools": offered}


def agentic_records(n: int) -> list[dict[str, Any]]:
    return [agentic_record(i) for i in range(n)]


def glaive_records(n: int) -> list[dict[str, Any]]:
    """The Glaive demo repeated to ``n`` records."""
    recs = json.loads(GLAIVE.read_text(encoding="utf-8"))
    return [recs[i % len(recs)] for i in range(n)]


def _write(path: Path, records: list[dict[str, Any]]) -> Path:
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
        tmp.rename(path)
    return path


def write_cases(n: int, work: Path = WORK) -> dict[str, dict[str, str]]:
    """``{case: {"data": jsonl, "warm": jsonl of its first WARM_RECORDS}}``, written once under ``work``."""
    out = {}
    for case, make in (("glaive", glaive_records), ("agentic", agentic_records)):
        recs = make(n)
        out[case] = {"data": str(_write(work / f"{case}_{n}.jsonl", recs)),
                     "warm": str(_write(work / f"{case}_warm.jsonl", recs[:WARM_RECORDS]))}
    return out


# --------------------------------------------------------------------------- one run (in the child)


def _stage(path: str) -> tuple[Any, Any, list]:
    """A Tokenizer for one JSONL file, its sink, and the file's blocks (read now)."""
    from pipelines.config import config_from_dict
    from pipelines.sources.listing import resolve_sources
    from pipelines.sources.read import ReadOptions, read_files
    from pipelines.stats import StatsSink
    from pipelines.tokenize.stage import Tokenizer

    cfg = config_from_dict({"model": {"tokenizer": str(SMOLLM2)}, "data": {
        "datasets": [{"path": path, "type": "chat_template"}], "on_bad_record": "skip", "sequence_len": 4096,
        "tokenize": {"num_actors": 1, "num_cpus": 0.5, "batch_size": 256, "threads": 1}}})
    table, sink = resolve_sources(cfg), StatsSink()
    opts = ReadOptions(table.storage, cfg.data.on_bad_record, tuple(d.text_field for d in table.datasets))
    blocks = list(read_files(list(table.files), opts, sink))
    return Tokenizer(cfg.data, cfg.model, table, sink, threads=1), sink, blocks


def measure_case(data: str, warm: str) -> dict[str, Any]:
    """Time the tokenizer stage over every block of ``data`` (this process's ``pipelines``)."""
    import pyarrow.compute as pc

    t0 = time.perf_counter()
    warm_tok, _, warm_blocks = _stage(warm)
    for b in warm_blocks:
        warm_tok(b)
    tok, sink, blocks = _stage(data)
    setup_s = time.perf_counter() - t0
    c0, t0 = time.process_time(), time.perf_counter()
    outs = [tok(b) for b in blocks]
    wall_s, cpu_s = time.perf_counter() - t0, time.process_time() - c0
    lengths = [pc.list_value_length(o["input_ids"]) for o in outs]
    tokens = sum(int(pc.sum(x).as_py() or 0) for x in lengths)
    records = sum(o.num_rows for o in outs)
    kept = sum(int(pc.sum(pc.greater(x, 0)).as_py() or 0) for x in lengths)
    counters = dict(sink.local.counters)
    return {"records": records, "samples": kept, "tokens": tokens, "wall_s": wall_s, "cpu_s": cpu_s,
            "tok_s": tokens / wall_s, "rec_s": records / wall_s, "tok_cpu_s": tokens / cpu_s, "setup_s": setup_s,
            "skipped_bad_record": counters.get("skipped_bad_record", 0),
            "skipped_no_trained_tokens": counters.get("skipped_no_trained_tokens", 0),
            "counters": counters, "blocks": len(blocks)}


def child_main(cases: dict[str, dict[str, str]]) -> None:
    import pipelines

    where = Path(pipelines.__file__).resolve().parents[1]
    out: dict[str, Any] = {"pipelines": str(where)}
    for case, paths in cases.items():
        out[case] = measure_case(paths["data"], paths["warm"])
    print(CHILD_TAG + json.dumps(out), flush=True)


# --------------------------------------------------------------------------- runs (in the parent)


def describe_root(root: Path) -> str:
    """``<short commit>`` of a checkout, ``+ uncommitted`` where ``git status`` shows changes under pipelines/."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, check=False).stdout.strip()

    head = git("rev-parse", "--short", "HEAD") or "?"
    return head + (" + uncommitted changes under pipelines/" if git("status", "--short", "--", "pipelines") else "")


def diff_sha1(root: Path) -> str | None:
    """The SHA-1 of ``git diff HEAD -- pipelines`` (None: no changes), to tell which uncommitted code ran."""
    import hashlib

    diff = subprocess.run(["git", "-C", str(root), "diff", "HEAD", "--", "pipelines"], capture_output=True,
                          check=False).stdout
    return hashlib.sha1(diff).hexdigest()[:12] if diff else None


def run_child(root: Path, cases: dict[str, dict[str, str]], timeout: float = 1200) -> dict[str, Any]:
    """One run of every case in a fresh process that imports ``root``'s ``pipelines``."""
    env = {**os.environ, **bl.CHILD_ENV, **THREAD_ENV, "PYTHONPATH": str(root)}
    quiet = bl.wait_quiet(max_busy=0.15, timeout_s=30)  # the machine's cores before the run (shared host)
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(cases)],
                          cwd=root, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(CHILD_TAG)]
    if proc.returncode or not lines:
        raise RuntimeError(f"child for {root} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    res = json.loads(lines[-1][len(CHILD_TAG):])
    if Path(res["pipelines"]) != root:
        raise RuntimeError(f"child for {root} imported pipelines from {res['pipelines']}")
    return {**res, "busy_before": quiet["busy"], "diff_sha1": diff_sha1(root)}


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def compare(roots: list[Path], cases: dict[str, dict[str, str]], runs: int, log: Any = sys.stderr) -> dict[str, Any]:
    """``runs`` runs of every root, the roots taking turns; per root and case the medians and spreads."""
    per: dict[str, list[dict[str, Any]]] = {str(r): [] for r in roots}
    for i in range(runs):
        for root in roots:
            res = run_child(root, cases)
            per[str(root)].append(res)
            log.write(f"run {i + 1}/{runs} {root} (machine {res['busy_before']:.0%} busy before): " + ", ".join(
                f"{c} {res[c]['tokens']:,} tok in {res[c]['wall_s']:.2f} s = {res[c]['tok_s']:,.0f} tok/s"
                for c in cases) + "\n")
            log.flush()
    summary: dict[str, Any] = {}
    for root in roots:
        rs = per[str(root)]
        summary[str(root)] = {"commit": describe_root(root), "diff_sha1": sorted({r["diff_sha1"] or "-" for r in rs}),
                              "busy_before": [r["busy_before"] for r in rs], "cases": {c: {
            "records": rs[0][c]["records"], "samples": rs[0][c]["samples"], "tokens": rs[0][c]["tokens"],
            "skipped_bad_record": rs[0][c]["skipped_bad_record"],
            "skipped_no_trained_tokens": rs[0][c]["skipped_no_trained_tokens"],
            "counters": rs[0][c]["counters"],
            **{k: _spread([r[c][k] for r in rs]) for k in ("tok_s", "rec_s", "wall_s", "cpu_s", "tok_cpu_s")},
        } for c in cases}, "runs": rs}
    return summary


def table(roots: list[Path], cases: list[str], summary: dict[str, Any]) -> str:
    """Per case and root: tokens/s (wall) and tokens per CPU-second of this process (both threads of the stage:
    formatting, and the encode thread), medians over the runs, with ratios to the first root."""
    names = ["old", "new"] if len(roots) == 2 else [r.name or str(r) for r in roots]
    base = summary[str(roots[0])]["cases"]
    head = ["case", "root", "records", "skipped", "tokens", "tokens/s median", "tokens/s min-max", "records/s median",
            "ratio tokens/s", "tokens per CPU-s median", "ratio tokens per CPU-s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in cases:
        for name, root in zip(names, roots, strict=True):
            s = summary[str(root)]["cases"][c]
            ratio = s["tok_s"]["median"] / base[c]["tok_s"]["median"]
            cpu_ratio = s["tok_cpu_s"]["median"] / base[c]["tok_cpu_s"]["median"]
            lines.append(f"| {c} | {name} ({summary[str(root)]['commit']}) | {s['records']:,} | {s['skipped_bad_record']} | "
                         f"{s['tokens']:,} | {s['tok_s']['median']:,.0f} | {s['tok_s']['min']:,.0f}-{s['tok_s']['max']:,.0f} | "
                         f"{s['rec_s']['median']:,.0f} | {ratio:.2f} | {s['tok_cpu_s']['median']:,.0f} | {cpu_ratio:.2f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", type=Path, action="append", default=None,
                    help="a checkout whose pipelines package to import (repeat for before/after, baseline first); "
                         "default: the checkout this script lives in")
    ap.add_argument("--runs", type=int, default=None, help="runs per root (default 5, --quick 1)")
    ap.add_argument("--records", type=int, default=None, help=f"records per case (default {FULL_RECORDS}, --quick "
                                                              f"{QUICK_RECORDS})")
    ap.add_argument("--quick", action="store_true", help="1 run on 300 records per case")
    ap.add_argument("--json", type=Path, default=None, help="also write the summary here")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        child_main(json.loads(args.child))
        return
    roots = [r.resolve() for r in (args.root or [ROOT])]
    runs = args.runs or (1 if args.quick else 5)
    n = args.records or (QUICK_RECORDS if args.quick else FULL_RECORDS)
    cases = write_cases(n)
    t0 = time.time()
    summary = compare(roots, cases, runs)
    print(table(roots, list(cases), summary))
    print(f"\n{runs} run(s) per root, {n:,} records per case, roots in turn; Rust tokenizer on 1 thread; "
          f"{time.time() - t0:.0f} s in all. Token counts differ between roots where the code renders tool calls "
          "and reasoning differently, so compare tokens/s.")
    for root in roots:
        for c in cases:
            s = summary[str(root)]["cases"][c]
            print(f"{root} {c}: counters {json.dumps(s['counters'], sort_keys=True)}")
    result = {"runs": runs, "records": n, "machine": bl.machine_info(), "roots": {r: {k: v for k, v in s.items() if k != "runs"} | {
        "runs": [{c: {k: x[c][k] for k in ("tokens", "wall_s", "cpu_s", "tok_s")} for c in cases} for x in s["runs"]]}
        for r, s in summary.items()}}
    print(RESULT_TAG + json.dumps(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
