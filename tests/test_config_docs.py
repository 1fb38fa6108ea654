"""docs/config.md: generated from the pydantic config models, and kept current.

The committed reference must equal a fresh rendering, so adding or changing a config field without
running ``python -m pipelines.config_docs`` fails here. The other tests pin down what the renderer
promises: every key reachable in a dumped config is documented (and nothing else), nested models and
list items get dotted sections, types, bounds and defaults are spelled out, internal fields stay out.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field

from pipelines.config import config_from_dict
from pipelines.config_docs import DEFAULT_OUTPUT, main, render_config_reference

REPO = Path(__file__).resolve().parents[1]
KEY_CELL = re.compile(r"^\| `([^`]+)` \|", re.M)


def documented_keys(markdown: str) -> list[str]:
    """The dotted keys in the first column of the reference's tables."""
    return KEY_CELL.findall(markdown)


def dumped_paths(value: Any, leaves: set[str], prefix: str = "") -> set[str]:
    """Dotted paths of a dumped config, descending until a path is a documented leaf key.

    Lists of mappings become ``key[]``; a documented dict-valued key (``role_map``, ``resources``)
    is a leaf, not a section.
    """
    if prefix in leaves or not isinstance(value, (dict, list)) or not value:
        return {prefix}
    if isinstance(value, list):
        items = [v for v in value if isinstance(v, dict)]
        return set().union(*(dumped_paths(v, leaves, f"{prefix}[]") for v in items)) if items else {prefix}
    paths: set[str] = set()
    for key, sub in value.items():
        paths |= dumped_paths(sub, leaves, f"{prefix}.{key}" if prefix else key)
    return paths


def test_docs_config_md_is_current() -> None:
    """docs/config.md is exactly what the models render today."""
    assert DEFAULT_OUTPUT == REPO / "docs" / "config.md"
    assert DEFAULT_OUTPUT.is_file(), "run: python -m pipelines.config_docs"
    assert DEFAULT_OUTPUT.read_text(encoding="utf-8") == render_config_reference(), (
        "docs/config.md is out of date: run python -m pipelines.config_docs"
    )


def test_every_dumped_key_is_documented_and_nothing_else() -> None:
    """The keys of a fully populated config, as pydantic dumps it, are exactly the documented ones.

    This checks the renderer's walk over the models against an independent source: model_dump.
    """
    cfg = config_from_dict(
        {
            "model": {"tokenizer": "t", "init": {"hidden_size": 64}},
            "data": {"datasets": [{"path": "a.jsonl"}], "eval_datasets": [{"path": "b.jsonl"}]},
            "scaling": {"resources_per_worker": {"GPU": 1}},
        }
    )
    markdown = render_config_reference()
    documented = documented_keys(markdown)
    assert len(documented) == len(set(documented)), "a key is documented twice"
    # Section keys (model, data.tokenize, ...) are rows too, and the walk descends into them.
    sections = {k for k in documented if any(d.startswith((f"{k}.", f"{k}[].")) for d in documented)}
    leaves = set(documented) - sections
    assert {"model", "data.tokenize", "data.datasets"} <= sections
    assert dumped_paths(cfg.model_dump(mode="json"), leaves) == leaves
    for key in (
        "data.datasets[].path",
        "data.tokenize.resources",
        "scaling.resources_per_worker",
        "model.init.seed",
    ):
        assert key in documented


def test_reference_spells_out_types_defaults_and_descriptions() -> None:
    """Rows carry the type with its bounds, the YAML default and the field's description."""
    markdown = render_config_reference()
    assert '| `train.deepspeed` | `str \\| dict[str, any]` | `"zero2"` | zero0..zero3' in markdown
    assert "| `data.sequence_len` | `int, > 1` | `2048` | Tokens per packed row" in markdown
    assert '| `data.packing` | `"none" \\| "concat" \\| "bfd"` | `"bfd"` |' in markdown
    assert "| `data.datasets` | `list[DatasetConfig], min length 1` | **required** |" in markdown
    assert "| `model.init` | `ModelInit \\| null` | `null` |" in markdown
    assert "## `data.datasets[]`" in markdown and "## `data.tokenize`" in markdown


def test_internal_fields_are_not_documented() -> None:
    """base_dir and source (set by the loader, excluded from dumps) do not appear as keys."""
    keys = documented_keys(render_config_reference())
    assert "base_dir" not in keys and "source" not in keys


class _Inner(BaseModel):
    """Inner settings."""

    x: int = Field(3, gt=0, description="An x | with a pipe and a <placeholder>.")


class _Item(BaseModel):
    """One item."""

    path: str


class _Root(BaseModel):
    """The root."""

    inner: _Inner = Field(default_factory=_Inner)
    items: list[_Item] = Field(..., min_length=1, description="The items.")
    maybe: _Inner | None = None
    mode: Literal["a", "b"] = "a"
    ratio: float = Field(0.5, ge=0, le=1)
    hidden: str = Field("x", exclude=True)


def test_renders_nested_optional_and_list_item_models() -> None:
    """A small model tree renders to the expected sections and rows, with table-safe cells."""
    markdown = render_config_reference(_Root)
    assert documented_keys(markdown) == [
        "inner", "items", "maybe", "mode", "ratio", "inner.x", "items[].path", "maybe.x",
    ]  # fmt: skip
    assert "| `inner` | `_Inner` | (section defaults) | Inner settings. See `inner`. |" in markdown
    assert "| `items` | `list[_Item], min length 1` | **required** | The items. See `items[]`. |" in markdown
    assert "| `items[].path` | `str` | **required** |  |" in markdown
    assert '| `mode` | `"a" \\| "b"` | `"a"` |  |' in markdown
    assert "| `ratio` | `float, >= 0, <= 1` | `0.5` |  |" in markdown
    assert "| `inner.x` | `int, > 0` | `3` | An x \\| with a pipe and a &lt;placeholder&gt;. |" in markdown
    assert "hidden" not in markdown
    assert markdown.index("## `inner`") < markdown.index("## `items[]`") < markdown.index("## `maybe`")


def test_cli_writes_then_checks(tmp_path: Path, capsys: Any) -> None:
    """`python -m pipelines.config_docs` writes the file; `--check` passes on it and fails once it drifts."""
    out = tmp_path / "docs" / "config.md"
    assert main(["--check", "--output", str(out)]) == 1  # missing
    assert main(["--output", str(out)]) == 0
    assert out.read_text(encoding="utf-8") == render_config_reference()
    assert main(["--check", "--output", str(out)]) == 0
    out.write_text(out.read_text(encoding="utf-8") + "edited by hand\n", encoding="utf-8")
    assert main(["--check", "--output", str(out)]) == 1
    assert "out of date" in capsys.readouterr().err
