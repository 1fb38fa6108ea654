"""notebooks/quickstart.ipynb runs top to bottom on CPU, and is committed without outputs."""

from __future__ import annotations

import json
import re

import pytest
from conftest import NOTEBOOK, NOTEBOOK_MODULES, NotebookRun


def test_committed_without_outputs():
    nb = json.loads(NOTEBOOK.read_text())
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert code and all(not c["outputs"] and c["execution_count"] is None for c in code)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_quickstart_executes(notebook_run: NotebookRun):
    """Run beside the other tests (``notebook_run`` in conftest.py): 12 steps, then LoRA."""
    if notebook_run.nb is None:
        pytest.skip(f"the notebook needs {', '.join(NOTEBOOK_MODULES)}")
    nb, tmp_path = notebook_run.nb, notebook_run.tmp
    text = "\n".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert "rows; columns:" in text and "loss " in text and "->" in text
    assert "parameters trained" in text and "adapter_model.safetensors" in text  # the LoRA cells
    images = [o for c in nb.cells for o in getattr(c, "outputs", []) if "image/png" in o.get("data", {})]
    assert len(images) == 2  # the length histogram and the loss curve
    html = [o for c in nb.cells for o in getattr(c, "outputs", []) if "text/html" in o.get("data", {})]
    assert html and "background:#cfc" in html[0]["data"]["text/html"]  # trained tokens highlighted
    # It learns: the loss the notebook prints falls, and so does the run's own record of it.
    first, last = map(float, re.search(r"loss (\d+\.\d+) -> (\d+\.\d+)", text).groups())
    records = (tmp_path / "runs" / "notebook-quickstart" / "metrics.jsonl").read_text().splitlines()
    losses = [r["loss"] for r in map(json.loads, records) if r.get("kind") == "train"]
    assert len(losses) == 6 and (first, last) == (round(losses[0], 3), round(losses[-1], 3))
    assert last < first - 0.2, losses
    adapter = json.loads((tmp_path / "runs" / "notebook-lora" / "adapter" / "adapter_config.json").read_text())
    assert adapter["peft_type"] == "LORA" and adapter["r"] > 0
