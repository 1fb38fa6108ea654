"""``data.tokenize.placement``: the tokenizer in an actor pool or inside the read tasks gives the same rows.

Inside the read tasks (fused by Ray Data: one operator, no actor) the stage gets its environment as the
tasks' ``runtime_env``, so the workers it ran in, which Ray would otherwise hand to later tasks and
actors, never pass on ``USE_TORCH=0`` or its thread settings.
"""

from __future__ import annotations

import json
import os

import pyarrow as pa
import pytest
from conftest import ALPACA, GLAIVE, SMOLLM2, make_config, needs_shared, write_jsonl

from pipelines.config import TokenizeConfig
from pipelines.dataset import tokenizer_placement

ROW_COLUMNS = ["input_ids", "labels", "position_ids", "sample_ids"]


def test_auto_places_a_lone_unplaced_tokenizer_in_the_read_tasks():
    # 2 CPUs, 1 CPU per tokenizer: the pool would be (1, 1), one actor doing what the read task could.
    assert tokenizer_placement(TokenizeConfig(), cpus=2) == "read_tasks"
    assert tokenizer_placement(TokenizeConfig(num_actors=1), cpus=64) == "read_tasks"
    # Room for more than one: a pool spreads the units of every read task over all its actors.
    assert tokenizer_placement(TokenizeConfig(), cpus=16) == "actors"
    assert tokenizer_placement(TokenizeConfig(num_cpus=0.5), cpus=2) == "actors"  # (1, 3)
    assert tokenizer_placement(TokenizeConfig(num_actors=2), cpus=2) == "actors"
    # Placed by a resource: the actors go where it says, so auto never moves them into the read tasks.
    assert tokenizer_placement(TokenizeConfig(resources={"cpu_node": 1}), cpus=2) == "actors"
    # As set.
    assert tokenizer_placement(TokenizeConfig(placement="actors"), cpus=2) == "actors"
    assert tokenizer_placement(TokenizeConfig(placement="read_tasks"), cpus=16) == "read_tasks"
    with pytest.raises(ValueError, match="placement"):
        TokenizeConfig(placement="driver")


def _rows(ds) -> pa.Table:
    return pa.concat_tables(ds.iter_batches(batch_size=None, batch_format="pyarrow")).select(ROW_COLUMNS)


def _operators(ds) -> list[str]:
    return [ln.split(":")[0] for ln in ds.stats().splitlines() if ln.startswith("Operator")]


def _read_stage(ds):
    """The stage the dataset's read tasks run their blocks through (``ShardDatasource.stage``)."""
    from ray.data._internal.logical.operators.read_operator import Read

    op = ds._logical_plan.dag
    while not isinstance(op, Read):
        (op,) = op.input_dependencies
    return op.datasource.stage


@needs_shared
def test_both_placements_give_the_rows_and_counts_of_the_local_path(ray_local, tmp_path):
    """Alpaca and tool-call chats (SmolLM2's chat template: the transformers tokenizer loads in the stage),
    3 files of several units each: the same rows in the same order and the same counters, either way."""
    from pipelines.dataset import (
        TokenizeAndPack,
        build_dataset,
        data_report,
        iter_packed_local,
        read_task_args,
        tokenizer_env,
    )

    alpaca = json.loads(ALPACA.read_text(encoding="utf-8"))
    glaive = json.loads(GLAIVE.read_text(encoding="utf-8"))
    (tmp_path / "alpaca").mkdir()
    for i in range(3):
        write_jsonl(tmp_path / "alpaca" / f"part-{i}.jsonl", alpaca[i * 200 : (i + 1) * 200])
    write_jsonl(tmp_path / "glaive.jsonl", glaive[:150])
    datasets = [{"path": str(tmp_path / "alpaca"), "type": "alpaca"},
                {"path": str(tmp_path / "glaive.jsonl"), "type": "chat_template"}]
    got: dict[str, pa.Table] = {}
    reports: dict[str, dict] = {}
    for placement in ("read_tasks", "actors"):
        cfg = make_config(datasets, tokenizer=SMOLLM2, sequence_len=1024, pack_buffer_size=64, deterministic=True,
                          mix_by="none", tokenize={"num_actors": 1, "num_cpus": 0.5, "threads": 1, "placement": placement})
        want = pa.concat_tables(iter_packed_local(cfg)).select(ROW_COLUMNS)
        ds = build_dataset(cfg)
        got[placement] = _rows(ds)
        assert got[placement].num_rows > 30 and got[placement].to_pylist() == want.to_pylist(), placement
        reports[placement] = data_report(ds)["counters"]
        if placement == "read_tasks":
            assert _operators(ds) == ["Operator 1 ReadReadShards"]  # inside the read tasks: tasks only
            assert _read_stage(ds).stage is TokenizeAndPack
            assert read_task_args(cfg, token_ids=False) == {
                "num_cpus": 0.5, "resources": None, "runtime_env": {"env_vars": tokenizer_env(1)}}
        else:
            assert _operators(ds) == ["Operator 1 ReadReadShards", "Operator 2 MapBatches(TokenizeAndPack)"]
            assert _read_stage(ds) is None
            assert read_task_args(cfg, token_ids=False) == {"num_cpus": cfg.data.read_num_cpus}
    assert reports["read_tasks"] == reports["actors"]
    assert reports["actors"]["samples_tokenized"] == 750 and reports["actors"]["tokens"] > 100_000
    assert reports["actors"]["rows"] == got["actors"].num_rows


@needs_shared
def test_the_read_workers_environment_stays_with_them(ray_local, tmp_path):
    """After a stream that tokenized chats inside the read tasks (transformers loaded there with
    ``USE_TORCH=0``, 1 Rust thread), plain tasks land in workers with the environment they had before. Were
    it set in the read worker's own process, Ray would hand that worker on, and a train worker there could
    not see torch."""
    import ray

    from pipelines.dataset import build_dataset

    @ray.remote(num_cpus=0.5)
    def probe() -> tuple[str | None, str | None]:
        return os.environ.get("USE_TORCH"), os.environ.get("RAYON_NUM_THREADS")

    # The workers' own environment (inherited from the process that started Ray: a test that tokenized in
    # this process before may have set the Rust threads there).
    before = set(ray.get([probe.remote() for _ in range(4)]))
    assert len(before) == 1 and ("0", "1") not in before  # a leak would be visible
    write_jsonl(tmp_path / "glaive.jsonl", json.loads(GLAIVE.read_text(encoding="utf-8"))[:100])
    cfg = make_config([{"path": str(tmp_path / "glaive.jsonl"), "type": "chat_template"}], tokenizer=SMOLLM2,
                      sequence_len=1024, tokenize={"num_actors": 1, "num_cpus": 0.5, "threads": 1,
                                                   "placement": "read_tasks"})
    assert _rows(build_dataset(cfg)).num_rows > 5
    after = ray.get([probe.remote() for _ in range(12)])
    assert set(after) == before, after
