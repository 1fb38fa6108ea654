"""``ray start --head`` on loopback, ``ray job submit --working-dir . -- python ray_jobs/sft.py``, outputs exist.

The head and the job (tests/ray_head_job.py) run beside the other tests (``job_submit_run`` in conftest.py);
the test reads what they left.
"""

from __future__ import annotations

import json

import pytest
from ray_head_job import JobSubmitRun


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_ray_job_submit_sft(job_submit_run: JobSubmitRun):
    res = job_submit_run
    out, run = res.output, res.run_dir
    assert res.returncode == 0, out[-4000:]
    assert "succeeded" in out
    assert f"  model:     {run}/model" in out  # the summary block (pipelines.train.metrics.format_summary)
    assert (run / "model" / "config.json").is_file() and (run / "model" / "tokenizer.json").is_file()
    assert (run / "checkpoint_00000006" / "trainer_state.json").is_file()
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()
             if json.loads(line)["kind"] == "train"]
    assert steps == [3, 6]
    # The head was stopped by pid, and nothing it started is left.
    assert res.head_exited and not res.left_alive, res.left_alive
