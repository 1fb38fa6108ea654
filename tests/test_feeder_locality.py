"""The feeder reads blocks where they lie: a block on another node is never pulled to the feeder's node.

On a cluster the packed blocks are made on the tokenizer nodes and trained on by every node; if
the feeder (on rank 0's node) fetched each block to read its row lengths and sample ids, rank 0's
node would receive every token of the run. A child process starts a loopback two-node cluster
(``ray.cluster_utils.Cluster``: the head and a ``far`` node), makes two blocks on ``far`` and one
on the head, and runs the feeder's block reader in an actor pinned to the head. The chunks must
carry exactly the rows' lengths, sample ids and unit columns, and the far blocks must still be only
on ``far`` afterwards (``ray.experimental.get_object_locations``).

    python tests/test_feeder_locality.py      # the child, standalone: prints LOCALITY {...}
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
ROWS, SEQ = 96, 1024  # ~0.8 MB of tokens per block: in the object store, not inlined (< 100 KB)


def block_rows(i: int) -> dict[str, list]:
    """Block ``i``'s packed rows as plain lists (seeded): what the chunk must describe."""
    rng = np.random.default_rng(i)
    lengths = rng.integers(SEQ // 2, SEQ + 1, ROWS)
    samples = [sorted(rng.choice(10_000, int(rng.integers(1, 5)), replace=False).tolist()) for _ in range(ROWS)]
    units = {k: (np.arange(ROWS) + 1000 * i + j).tolist() for j, k in enumerate(
        ("unit_id", "unit_row", "unit_rows", "unit_start_byte", "unit_end_row", "unit_end_byte"))}
    ids = [rng.integers(0, 50_000, n).tolist() for n in lengths]
    return {"input_ids": ids, "labels": ids, "position_ids": [list(range(n)) for n in lengths],
            "sample_ids": samples, **units}


def child() -> None:
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    import pyarrow as pa
    import ray
    from ray.cluster_utils import Cluster
    from ray.experimental import get_object_locations
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from pipelines.ray_local import LOOPBACK, keep_on_loopback

    keep_on_loopback()
    cluster = Cluster(initialize_head=True, head_node_args={
        "node_ip_address": LOOPBACK, "num_cpus": 1, "include_dashboard": False})
    # 4 CPUs: from_arrow_refs runs one 1-CPU metadata task per block, and they must all fit where the blocks are.
    far = cluster.add_node(node_ip_address=LOOPBACK, num_cpus=4, resources={"far": 1})
    ray.init(address=cluster.address, log_to_driver=False)
    head = ray.get_runtime_context().get_node_id()

    @ray.remote(num_cpus=0)
    def make_block(i: int) -> tuple[pa.Table, str]:
        return pa.table(block_rows(i)), ray.get_runtime_context().get_node_id()

    @ray.remote(num_cpus=0)
    class Reader:
        def node(self) -> str:
            return ray.get_runtime_context().get_node_id()

        def chunks(self, ds: ray.data.Dataset) -> list[tuple]:
            from pipelines.stream.blocks import chunks_of as _chunks_of

            return [(c.block, c.offset, c.tokens, c.sample_offsets, c.sample_values, c.units) for c in _chunks_of(ds)]

    made = [make_block.options(num_returns=2, resources={"far": 0.01} if i != 1 else {},
                               scheduling_strategy=None if i != 1 else NodeAffinitySchedulingStrategy(head, False))
            .remote(i) for i in range(3)]
    refs = [m[0] for m in made]
    made_on = ray.get([m[1] for m in made])
    ray.wait(refs, num_returns=len(refs), fetch_local=False)
    reader = Reader.options(scheduling_strategy=NodeAffinitySchedulingStrategy(head, soft=False)).remote()
    reader_node = ray.get(reader.node.remote())
    got = ray.get(reader.chunks.remote(ray.data.from_arrow_refs(refs)))
    locations = get_object_locations(refs)  # before anything here could fetch a block
    out = {
        "head": head, "far": far.node_id, "reader_node": reader_node, "made_on": made_on,
        "locations": [sorted(locations[r]["node_ids"]) for r in refs],
        "chunk_blocks": [refs.index(c[0]) if c[0] in refs else None for c in got],
        "chunks": [{"offset": c[1], "tokens": c[2].tolist(), "sample_offsets": c[3].tolist(),
                    "sample_values": c[4].tolist(), "units": {k: v.tolist() for k, v in c[5].items()}} for c in got],
    }
    print("LOCALITY " + json.dumps(out), flush=True)
    ray.shutdown()
    cluster.shutdown()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_far_blocks_are_described_where_they_lie_and_never_pulled_to_the_feeder():
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run([sys.executable, __file__], cwd=ROOT, env=env, capture_output=True, text=True, timeout=560)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("LOCALITY ")]
    assert proc.returncode == 0 and lines, (proc.stdout + proc.stderr)[-4000:]
    res = json.loads(lines[-1].removeprefix("LOCALITY "))
    head, far = res["head"], res["far"]
    assert head != far and res["reader_node"] == head
    assert res["made_on"] == [far, head, far]
    # Every block whole, in order, with exactly its rows' lengths, sample ids and unit columns.
    assert res["chunk_blocks"] == [0, 1, 2]
    for i, chunk in enumerate(res["chunks"]):
        rows = block_rows(i)
        assert chunk["offset"] == 0
        assert chunk["tokens"] == [len(r) for r in rows["input_ids"]]
        assert chunk["sample_values"] == [s for r in rows["sample_ids"] for s in r]
        assert np.diff(chunk["sample_offsets"]).tolist() == [len(r) for r in rows["sample_ids"]]
        assert chunk["units"] == {k: rows[k] for k in chunk["units"]} and len(chunk["units"]) == 6
    # The far blocks are still only on the far node: the reader on the head never pulled them.
    assert res["locations"] == [[far], [head], [far]], res["locations"]


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    child()
