"""Time to resume after a node loss, and the work redone, in an elastic run (issue 44).

    python benchmarks/elastic_resume.py            # both checkpoint policies, one run each (~3 min each here)

Each run is ``tests/node_loss_cluster.py`` in a child process: a loopback Ray cluster of a head, a CPU node
for the tokenizers and two training nodes; ``scaling.num_workers: [1, 2]``, ZeRO-2, the tiny Llama of
tests/test_exactly_once_train.py, 14 steps. Once step 7 is logged, the training node of rank 0 (and of the
data feeder) is lost without notice (its raylet and every process on it killed) and not replaced: the group
restarts with one worker. Two checkpoint policies, the same loss:

* ``steps``: ``train.checkpoint_every_steps: 4`` (the last checkpoint before the loss is step 4);
* ``minutes``: ``train.checkpoint_every_minutes: 0.1`` (6 s, about as often as every 4 steps here).

Reported from the run's ``recovery`` record (pipelines.train.metrics.recovery_record): the step resumed
from, the steps redone (from it to the last logged step before the loss), and the seconds from that last
logged step to the first step after the restart, which is the time lost to the node: noticing it, Ray Train's
first restart at the old size and its start timeout (``RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S``, 30 s here,
60 s by Ray's default), starting the new group, building the engine, converting and loading the checkpoint.
Prints a markdown table and ``RESULT {json}``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
POLICIES = {"steps": "checkpoint_every_steps: 4", "minutes": "checkpoint_every_minutes: 0.1"}


def run_policy(policy: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="elastic-resume-") as tmp:
        t0 = time.time()
        env = {**os.environ, "RAY_ADDRESS": "", "PYTHONUNBUFFERED": "1"}
        proc = subprocess.run([sys.executable, str(ROOT / "tests" / "node_loss_cluster.py"), tmp, f"bench_{policy}"],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
        lines = [x for x in proc.stdout.splitlines() if x.startswith("NODE_LOSS ")]
        if proc.returncode or not lines:
            raise RuntimeError(f"{policy}: the run failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
        res = json.loads(lines[-1].removeprefix("NODE_LOSS "))
        if not res["ok"] or res["chaos_error"]:
            raise RuntimeError(f"{policy}: {res}")
        recs = [json.loads(x) for x in (Path(tmp) / "runs" / res["name"] / "metrics.jsonl").read_text().splitlines()]
        summary = [r for r in recs if r["kind"] == "summary"][-1]
        (recovery,) = summary["recoveries"]
        killed = next(e for e in res["events"] if "killed" in e)
        return {"policy": policy, "setting": POLICIES[policy], "lost_after_step": recovery["last_logged_step"],
                "resumed_from_step": recovery["step"], "steps_redone": recovery["steps_redone"],
                "time_lost_s": recovery["time_lost_s"], "workers": f"{recovery['from_workers']} -> "
                f"{recovery['to_workers']}", "killed": killed["killed"], "run_s": round(time.time() - t0, 1),
                "final_step": summary["step"]}


def main() -> None:
    rows = [run_policy(p) for p in POLICIES]
    print("| checkpoints | lost after step | resumed from | steps redone | time lost (s) | workers |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['setting']} | {r['lost_after_step']} | {r['resumed_from_step']} | {r['steps_redone']} | "
              f"{r['time_lost_s']} | {r['workers']} |")
    print("RESULT " + json.dumps(rows))


if __name__ == "__main__":
    main()
