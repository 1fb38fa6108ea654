"""A multi-node Ray cluster on loopback that loses nodes mid-epoch (run by tests/test_node_loss.py).

Run as a child process (it starts its own Ray)::

    python tests/node_loss_cluster.py <tmp dir> <scenario>[,<scenario>...]

The scenarios run one after another on one cluster; before each, the nodes the one before lost are replaced
(``_topology``), so each starts from the nodes below.

Nodes (``ray.cluster_utils.Cluster``, every raylet on 127.0.0.1, each its own node to Ray):

    head        the driver and Ray Train's controller; CPU for read tasks
    cpu         {cpu_node: 2}: the tokenizer actors (data.tokenize.resources {cpu_node: 1}), one per mixed source:
                the two sources stream side by side, so both pools must fit at once
    train-a/b   {train_node: 1} each: one training worker per node (scaling.resources_per_worker)

Scenarios:

* ``recover``: once the second checkpoint is saved (and in the ledger), kill (SIGKILL of all its processes)
  the training node that holds rank 0 and the data feeder; once the restored run has started the
  tokenizer actors of its new stream, kill the CPU node. After each kill a fresh node with the same
  resources joins, as a cluster autoscaler would replace it. ``run.max_failures=3``; 2 workers with the
  elastic run's settings (ZeRO-2, its learning rate), so that its losses are the elastic run's reference.
* ``fail``: the same first kill with ``run.max_failures=0``: the fit fails.
* ``elastic``: ``scaling.num_workers: [1, 2]`` with ZeRO-2. Once the second checkpoint is saved, kill the
  training node of rank 0 and the feeder, with no replacement: the group restarts with 1 worker. Once that
  worker has written a checkpoint of its own, add the node back: Ray Train's resize check grows the group
  to 2 again. Its losses are compared with the ``recover`` run's.
* ``min_workers``: ``scaling.num_workers: [2, 3]``; kill a training node with no replacement: one worker
  can be placed, fewer than the min, and the run fails after ``scaling.min_workers_timeout_s``.
* ``bench_steps`` / ``bench_minutes`` (benchmarks/elastic_resume.py): ``[1, 2]`` workers, 14 steps, checkpoints
  every 4 steps or every 0.1 minutes; the node of rank 0 is lost without notice once step 7 is logged.
* ``preempt``: ``scaling.num_workers: [1, 2]``, no periodic checkpoints. A spot reclaim with notice: the node of
  rank 0 and the feeder is drained with reason preemption and a 60 s deadline, with the command the KubeRay
  manifest's preStop hook runs on the pod's SIGTERM; once the run has checkpointed for the notice, the node
  goes. The group restarts with 1 worker from that checkpoint.

Prints one ``NODE_LOSS {...}`` JSON line per scenario: what was killed, the fit's outcome and error.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # before ray is imported: nodes stay on 127.0.0.1

import pyarrow.fs as pafs  # noqa: E402
import ray  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402
from test_exactly_once_train import _config, _ledger  # noqa: E402

from pipelines.ray_local import LOOPBACK, keep_on_loopback  # noqa: E402
from pipelines.train.checkpoint import checkpoint_dir_name, checkpoint_problem  # noqa: E402

# Node deaths are noticed within ~3 s instead of Ray's default ~30 s.
HEALTH = {"health_check_initial_delay_ms": 1000, "health_check_period_ms": 1000, "health_check_failure_threshold": 3}
CPU_NODE = {"num_cpus": 1, "resources": {"cpu_node": 2}}  # one slot per mixed source's tokenizer pool
TRAIN_NODE = {"num_cpus": 1, "resources": {"train_node": 1}}
# The elastic scenario's learning rate. A resize changes the order in which gradients are summed, and Adam
# amplifies that rounding noise step by step: over this run's 32 steps the largest relative loss difference to
# the uninterrupted run was 4.3e-5 at 3e-4, 9.6e-5 at 1e-3 and 2.0e-3 at 3e-3 (measured on this tiny model).
LOSS_CURVE_LR = 3e-4
# Seconds every rank waits after each step (PIPELINES_FAULTS "slow:", pipelines.train.faults): a step of the tiny
# model takes ~0.1 s, so the 32 steps would end before the chaos has acted. Each scenario's must outlast what
# it waits for: the elastic group's growth back (the added node is seen by Ray Train within ~20-35 s) with its
# 1-worker group's ~26 steps; the preemption notice after step 3 (Ray's watcher polls every 5 s, the run asks it
# every 2 s: on 2026-12-07 it came 7 steps after the drain at 0.5 s a step), then its checkpoint's upload and
# the reclaim, all before the run's last step, on a machine the other tests keep busy; a kill after checkpoint 4.
# The benchmark's clock policy (every 0.1 minutes) is then about every 4 steps.
SLOW_S = {"elastic": 2.0, "preempt": 1.0, "bench_steps": 1.5, "bench_minutes": 1.5}
SLOW_DEFAULT_S = 0.5
# How long an elastic run may have no running worker group (scaling.min_workers_timeout_s). The min_workers
# scenario waits it out, so it is short there. The others must never reach it: after a node loss the group's
# first restart tries the old size (Ray's stale view of the cluster) for the 30 s start timeout before it
# restarts smaller, and MinWorkersTimeout counts that try too (pipelines/train/elastic.py). At 45 s the elastic
# run had ~15 s to spare on a quiet machine.
MIN_WORKERS_TIMEOUT_S = {"min_workers": 45.0}
MIN_WORKERS_TIMEOUT_DEFAULT_S = 180.0
# A spot reclaim's notice, as the preStop hook of cluster/kuberay/rayjob-elastic.yaml gives it.
DRAIN_ARGS = ["--reason", "DRAIN_NODE_REASON_PREEMPTION", "--reason-message", "spot reclaim (SIGTERM)",
              "--deadline-remaining-seconds", "60"]


def _actors(class_name: str) -> dict[str, str]:
    """Actor id -> node id of the live actors whose class name contains ``class_name`` (GCS actor table)."""
    return {a["ActorID"]: a["Address"]["NodeID"] for a in ray._private.state.actors().values()
            if class_name in a["ActorClassName"] and a["State"] == "ALIVE"}


def _wait(what: str, cond, timeout: float = 300.0, fit: threading.Thread | None = None) -> None:
    """Poll ``cond`` until it holds; raise after ``timeout`` seconds, or at once when ``fit`` has ended (a fit
    that failed early would otherwise be waited on for the whole timeout)."""
    t0 = time.time()
    while not cond():
        if time.time() - t0 > timeout:
            raise TimeoutError(f"timed out waiting for {what}")
        if fit is not None and not fit.is_alive() and not cond():
            raise RuntimeError(f"the fit ended while waiting for {what}")
        time.sleep(0.2)


class Chaos:
    """Kills (and replaces) nodes while the fit runs; records what it did."""

    def __init__(self, cluster: Cluster, nodes: dict[str, object], tmp: Path, name: str, scenario: str,
                 fit: threading.Thread) -> None:
        self.cluster, self.nodes, self.tmp, self.name, self.scenario = cluster, nodes, tmp, name, scenario
        self.fit = fit  # the fit's thread: a wait ends when it does
        self.events: list[dict] = []
        self.error: str | None = None

    def _wait(self, what: str, cond, timeout: float = 300.0) -> None:
        _wait(what, cond, timeout, fit=self.fit)

    def label(self, node_id: str) -> str:
        """``train-a``, ``cpu'`` (a replacement), ``head``: the name of a node id in this script."""
        if node_id == self.cluster.head_node.node_id:
            return "head"
        return next((k for k, n in self.nodes.items() if n.node_id == node_id), node_id[:8])

    def _steps(self) -> int:
        try:
            return len(_ledger(self.tmp, self.name))
        except (FileNotFoundError, OSError):
            return 0

    def _checkpoints(self) -> list[int]:
        """Steps of the checkpoint directories on the run's storage."""
        run = self.tmp / "runs" / self.name
        return [int(p.name.split("_")[1]) for p in run.glob("checkpoint_*") if p.is_dir()] if run.is_dir() else []

    def _event(self, **event) -> None:
        self.events.append(event)
        print("CHAOS " + json.dumps(event), flush=True)

    def _kill(self, label: str, replacement: dict | None) -> None:
        node = self.nodes.pop(label)
        self._event(killed=label, ledger_steps=self._steps(), t=round(time.time(), 1))
        self.cluster.remove_node(node, allow_graceful=False)
        if replacement is not None:
            self.nodes[label + "'"] = self.cluster.add_node(node_ip_address=LOOPBACK, **replacement)
            self._event(added=label + "'", t=round(time.time(), 1))

    def _records(self, kind: str) -> list[dict]:
        path = self.tmp / "runs" / self.name / "metrics.jsonl"
        if not path.exists():
            return []
        recs = []
        for line in path.read_text().splitlines():
            try:
                recs.append(json.loads(line))
            except ValueError:
                continue
        return [r for r in recs if r.get("kind") == kind]

    def run(self) -> None:
        if self.scenario in ("elastic", "min_workers"):
            return self.shrink_and_grow()
        if self.scenario == "preempt":
            return self.preempt()
        if self.scenario.startswith("bench_"):
            return self.lose_at(7)
        try:
            # Checkpoint 2 (step 4) is in the ledger once its data state is taken, before it is saved
            # (the ledger is written ahead), so wait for its directory too: killed before that, the run
            # restores checkpoint 1 (correct, but no test of a mid-epoch restore).
            self._wait("the second checkpoint", lambda: self._steps() >= 4 and max(self._checkpoints(), default=0) >= 4)
            feeder = set(_actors("Feeder").values())  # pipelines.stream.feeder.DataFeeder: the Feeder class as an actor
            tokenizers = set(_actors("MapWorker"))
            self._event(train_worker_nodes=sorted(self.label(n) for n in _actors("RayTrainWorker").values()),
                        feeder_node=sorted(self.label(n) for n in feeder))
            holder = [k for k, n in self.nodes.items() if k.startswith("train") and n.node_id in feeder]
            if len(holder) != 1:
                raise RuntimeError(f"the data feeder is not on one training node: {self.events[-1]}")
            self._kill(holder[0], TRAIN_NODE if self.scenario == "recover" else None)
            if self.scenario != "recover":
                return
            # The restored worker group starts a new feeder, whose stream starts new tokenizer actors:
            # the CPU node goes while they tokenize the rest of the epoch.
            self._wait("the restored run's tokenizer", lambda: set(_actors("MapWorker")) - tokenizers)
            new = {a: n for a, n in _actors("MapWorker").items() if a not in tokenizers}
            self._event(tokenizer_nodes=sorted(self.label(n) for n in new.values()))
            self._kill("cpu", CPU_NODE)
        except BaseException:
            self.error = traceback.format_exc()
            print("CHAOS_ERROR " + self.error, flush=True)

    def _feeder_node(self) -> str:
        """The training node that holds rank 0 and the data feeder (the feeder lives on rank 0's node)."""
        feeder = set(_actors("Feeder").values())
        (holder,) = [k for k, n in self.nodes.items() if k.startswith("train") and n.node_id in feeder]
        return holder

    def lose_at(self, step: int) -> None:
        """benchmarks/elastic_resume.py: lose the training node of rank 0 once ``step`` is logged, no notice."""
        try:
            self._wait(f"step {step}", lambda: max((r["step"] for r in self._records("train")), default=0) >= step)
            holder = self._feeder_node()
            self._kill(holder, None)
        except BaseException:
            self.error = traceback.format_exc()
            print("CHAOS_ERROR " + self.error, flush=True)

    def preempt(self) -> None:
        try:
            self._wait("step 3", lambda: max((r["step"] for r in self._records("train")), default=0) >= 3)
            holder = self._feeder_node()
            # What cluster/kuberay/rayjob-elastic.yaml's preStop hook runs in the pod (there without --node-id:
            # the pod's own node).
            subprocess.run(["ray", "drain-node", "--address", self.cluster.address, "--node-id",
                            self.nodes[holder].node_id, *DRAIN_ARGS], check=True, capture_output=True, text=True,
                           env={**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"})
            self._event(drained=holder, at_step=max(r["step"] for r in self._records("train")))
            self._wait("the checkpoint for the notice", lambda: any("preemption notice" in r["reason"]
                                                                for r in self._records("checkpoint")), timeout=60)
            step = [r for r in self._records("checkpoint") if "preemption" in r["reason"]][0]["step"]
            self._event(noticed=step)
            # The node goes at the notice's deadline, 60 s on: long after the checkpoint's upload (in the background)
            # is complete on storage, which is all the test waits for.
            path = self.tmp / "runs" / self.name / checkpoint_dir_name(step)
            self._wait("the notice's checkpoint on storage", lambda: path.is_dir() and checkpoint_problem(
                pafs.LocalFileSystem(), str(path)) is None, timeout=60)
            self._kill(holder, None)  # the reclaim
        except BaseException:
            self.error = traceback.format_exc()
            print("CHAOS_ERROR " + self.error, flush=True)

    def shrink_and_grow(self) -> None:
        try:
            self._wait("the second checkpoint", lambda: self._steps() >= 4 and max(self._checkpoints(), default=0) >= 4)
            feeder = set(_actors("Feeder").values())
            self._event(train_worker_nodes=sorted(self.label(n) for n in _actors("RayTrainWorker").values()),
                        feeder_node=sorted(self.label(n) for n in feeder))
            self._kill(self._feeder_node(), None)
            if self.scenario != "elastic":
                return
            # The group restarts with the one worker that can be placed; let it write a checkpoint of its own,
            # so that growing back loads a 1-worker checkpoint at 2 workers.
            self._wait("the one-worker group's first checkpoint", lambda: any(
                r["world_size"] == 1 for r in self._records("resume")) and max(self._checkpoints(), default=0)
                > max(r["step"] for r in self._records("resume")))
            self._event(shrunk_to=1, checkpoints=sorted(self._checkpoints()), ledger_steps=self._steps())
            self.nodes["train-back"] = self.cluster.add_node(node_ip_address=LOOPBACK, **TRAIN_NODE)
            self._event(added="train-back", t=round(time.time(), 1))
            self._wait("the group to grow back to 2", lambda: any(r["world_size"] == 2 and r["saved_world_size"] == 1
                                                             for r in self._records("resume")))
            self._event(grown_to=2, ledger_steps=self._steps())
        except BaseException:
            self.error = traceback.format_exc()
            print("CHAOS_ERROR " + self.error, flush=True)


def _scenario_config(tmp: Path, name: str, scenario: str):
    """The run of each scenario: tests/test_exactly_once_train.py's tiny run, placed on the nodes above."""
    placed = {"tokenize": {"num_actors": 1, "num_cpus": 0.25, "resources": {"cpu_node": 1}},
              "worker_resources": {"CPU": 0.5, "train_node": 1}}
    if scenario == "fail":
        return _config(tmp, name, 2, checkpoint_every_steps=2, max_failures=0, **placed)
    if scenario.startswith("bench_"):  # checkpoints every 4 steps, or every 0.1 min (~4 steps here)
        every = {"checkpoint_every_steps": 4} if scenario == "bench_steps" else {
            "checkpoint_every_steps": None, "checkpoint_every_minutes": 0.1}
        cfg = _config(tmp, name, [1, 2], max_failures=-1, deepspeed="zero2", max_steps=14, **every, **placed)
        cfg.run.checkpoint_upload = "async"
        return cfg
    # recover: 2 workers, fixed; its losses are the elastic run's reference (a restore at the same world size
    # trains every step as the uninterrupted run does: tests/test_exactly_once_train.py checks that).
    workers = {"min_workers": [2, 3], "recover": 2}.get(scenario, [1, 2])
    cfg = _config(tmp, name, workers, max_failures=3 if scenario == "recover" else -1, deepspeed="zero2",
                  checkpoint_every_steps=None if scenario == "preempt" else 2, learning_rate=LOSS_CURVE_LR, **placed)
    cfg.scaling.resize_check_s = 2.0
    cfg.scaling.min_workers_timeout_s = MIN_WORKERS_TIMEOUT_S.get(scenario, MIN_WORKERS_TIMEOUT_DEFAULT_S)
    cfg.run.checkpoint_upload = "async"  # as configs/llama3-8b-sft-elastic.yaml: faults land during uploads too
    return cfg


def _topology(cluster: Cluster, nodes: dict[str, object]) -> dict[str, object]:
    """The nodes a scenario starts from: ``cpu``, ``train-a`` and ``train-b``. The nodes a scenario before lost are
    replaced (as a cluster autoscaler would), and the survivors are labelled afresh."""
    trains = [n for k, n in nodes.items() if k.startswith("train")]
    cpus = [n for k, n in nodes.items() if k.startswith("cpu")]
    while len(trains) < 2:
        trains.append(cluster.add_node(node_ip_address=LOOPBACK, **TRAIN_NODE))
    if not cpus:
        cpus.append(cluster.add_node(node_ip_address=LOOPBACK, **CPU_NODE))
    return {"cpu": cpus[0], "train-a": trains[0], "train-b": trains[1]}


# A start timeout given to this script wins over the scenarios' own.
_START_TIMEOUT = os.environ.get("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S")


def run_scenario(cluster: Cluster, nodes: dict[str, object], tmp: Path, scenario: str) -> dict:
    """One scenario's fit on the cluster, with its chaos beside it; what happened (the ``NODE_LOSS`` line)."""
    name = f"nodeloss_{scenario}"
    cfg = _scenario_config(tmp, name, scenario)
    # A replacement node takes ~30 s to join on a busy 2-core machine: wait for it, not Ray's 60 s. An elastic
    # run's first restart after a node loss tries the old size (Ray's view of the cluster is refreshed every
    # 20 s) and waits this long before it restarts with the workers that can be placed: 30 s here. Read by
    # Ray Train from the driver's environment when the fit starts.
    os.environ["RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"] = _START_TIMEOUT or (
        "300" if scenario in ("recover", "fail") else "30")
    os.environ["PIPELINES_FAULTS"] = f"slow:{SLOW_S.get(scenario, SLOW_DEFAULT_S)}"  # read when the fit starts
    from pipelines.train.trainer import build_trainer

    outcome = {"ok": False, "error": None, "error_type": None}

    def fit() -> None:
        try:
            build_trainer(cfg).fit()
            outcome["ok"] = True
        except Exception as err:  # the failing scenario's expected end; reported to the test
            outcome["error"], outcome["error_type"] = f"{err}", type(err).__name__

    # The fit runs in a thread: Cluster.add_node must run in the main thread (it installs signal handlers).
    thread = threading.Thread(target=fit, daemon=True)
    t0 = time.monotonic()
    thread.start()
    chaos = Chaos(cluster, nodes, tmp, name, scenario, thread)
    chaos.run()
    thread.join(timeout=None if chaos.error is None else 1)  # a failed kill plan must not wait on a stuck fit
    return {**outcome, "scenario": scenario, "events": chaos.events, "chaos_error": chaos.error, "name": name,
            "done": not thread.is_alive(), "wall_s": round(time.monotonic() - t0, 1)}


def main(tmp: Path, scenarios: list[str]) -> None:
    """Run ``scenarios`` one after another on one cluster (its start is paid once); one ``NODE_LOSS`` line each."""
    # tests/conftest.py (imported above through test_exactly_once_train) makes Ray Train poll its workers every
    # 0.25 s for the in-process tests; these scenarios run with Ray's default, as a user's cluster does (with
    # the fast poll, on 2026-12-07, the elastic group did not grow back, the preemption notice came after the
    # run's end and the fit of ``fail`` reported the surviving rank's gloo error instead of the lost node).
    os.environ.pop("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", None)
    keep_on_loopback()
    cluster = Cluster(initialize_head=True, head_node_args={
        "node_ip_address": LOOPBACK, "num_cpus": 1, "include_dashboard": False, "_system_config": HEALTH})
    nodes = _topology(cluster, {})
    ray.init(address=cluster.address, log_to_driver=False)
    for scenario in scenarios:
        nodes = _topology(cluster, nodes)
        res = run_scenario(cluster, nodes, tmp, scenario)
        print("NODE_LOSS " + json.dumps(res), flush=True)
        if not res["done"]:  # a fit still running would take the next scenario's nodes
            break
    ray.shutdown()
    cluster.shutdown()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2].split(","))
    os._exit(0)
