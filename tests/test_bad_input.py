"""Bad input: a clear error naming file and line, or skip-and-count with data.on_bad_record: skip.

Each case writes one good record and one bad one; ``raise`` must name the file and the bad line,
``skip`` must yield the good record and count the bad one. Most cases run the stages in-process
(``iter_packed_local``); the last tests run the same through Ray to show the error and the counts
survive the trip through actors.
"""

from __future__ import annotations

import json

import pytest
from conftest import GPT2, SMOLLM2, make_config, needs_shared, write_jsonl

from pipelines.sources.listing import SourceError, split_sample_id
from pipelines.sources.read import BadRecordError
from pipelines.stats import StatsSink
from pipelines.stream.dataset import build_dataset, data_report
from pipelines.stream.stages import iter_packed_local

pytestmark = needs_shared

GOOD = {"instruction": "Say hi", "input": "", "output": "hi"}

# name -> (dataset type, bad line content (bytes), expected message part, counter)
CASES = {
    "malformed_json": ("alpaca", b'{"instruction": "x", "output": ', "malformed JSON", "skipped_bad_record"),
    "non_utf8": ("alpaca", b'{"instruction": "caf\xe9", "output": "x"}', "not valid UTF-8", "skipped_bad_bytes"),
    "missing_field": ("alpaca", json.dumps({"instruction": "x"}).encode(), "missing field 'output'", "skipped_bad_record"),
    "wrong_type": ("alpaca", json.dumps({"instruction": "x", "output": 3}).encode(),
                   "field 'output' should be a string, got int", "skipped_bad_record"),
    "empty_text": ("completion", json.dumps({"text": "   "}).encode(), "field 'text' is empty", "skipped_bad_record"),
    "not_an_object": ("alpaca", b'["a", "b"]', "should be a JSON object", "skipped_bad_record"),
    "fractional_ids": ("completion", json.dumps({"input_ids": [464.5, 2068]}).encode(),  # not cast to [464, 2068]
                       "input_ids/labels should be lists of integers", "skipped_bad_record"),
    "no_assistant_turn": ("chat_template", json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode(),
                          "conversation has no assistant turn", "skipped_bad_record"),
    "unknown_role": ("chat_template", json.dumps({"messages": [{"role": "wizard", "content": "x"},
                                                               {"role": "assistant", "content": "y"}]}).encode(),
                     "unknown role 'wizard'", "skipped_bad_record"),
    "empty_assistant": ("chat_template", json.dumps({"messages": [{"role": "user", "content": "hi"},
                                                                  {"role": "assistant", "content": ""}]}).encode(),
                        "no trained tokens", "skipped_no_trained_tokens"),
}
GOOD_BY_TYPE = {
    "alpaca": json.dumps(GOOD).encode(),
    "completion": json.dumps({"text": "hello"}).encode(),
    "chat_template": json.dumps({"messages": [{"role": "user", "content": "hi"},
                                              {"role": "assistant", "content": "hello"}]}).encode(),
}


def _case_config(tmp_path, name, mode):
    typ, bad, _, _ = CASES[name]
    path = tmp_path / f"{name}.jsonl"
    path.write_bytes(GOOD_BY_TYPE[typ] + b"\n" + bad + b"\n")
    tok = SMOLLM2 if typ == "chat_template" else GPT2
    return path, make_config([{"path": str(path), "type": typ}], tokenizer=tok, on_bad_record=mode, sequence_len=64)


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_record_raises_naming_file_and_line(tmp_path, name):
    path, cfg = _case_config(tmp_path, name, "raise")
    with pytest.raises(BadRecordError) as err:
        list(iter_packed_local(cfg))
    msg = str(err.value)
    assert f"{path} line 2" in msg and CASES[name][2] in msg


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_record_skipped_and_counted(tmp_path, name):
    path, cfg = _case_config(tmp_path, name, "skip")
    sink = StatsSink()
    rows = [r for t in iter_packed_local(cfg, sink=sink) for r in t.to_pylist()]
    sample_ids = [s for r in rows for s in r["sample_ids"]]
    assert [split_sample_id(s) for s in sample_ids] == [(0, 0)]  # only the good line 1 survives
    key = CASES[name][3]
    assert sink.local.counters[key] == 1
    assert f"{path} line 2" in sink.local.examples[key][0]


@pytest.mark.parametrize("policy", ["truncate", "drop"])
def test_sample_over_sequence_len_follows_policy(tmp_path, policy):
    long = {"text": " ".join(["word"] * 100)}
    path = write_jsonl(tmp_path / "long.jsonl", [{"text": "short"}, long])
    cfg = make_config([{"path": str(path), "type": "completion"}], sequence_len=32, oversize=policy)
    sink = StatsSink()
    rows = [r for t in iter_packed_local(cfg, sink=sink) for r in t.to_pylist()]
    assert all(len(r["input_ids"]) <= 32 for r in rows)
    ids = sorted(s for r in rows for s in r["sample_ids"])
    if policy == "truncate":
        assert len(ids) == 2 and sink.local.counters["truncated_samples"] == 1
        assert sink.local.counters["truncated_tokens"] == 101 - 32
    else:
        assert len(ids) == 1 and sink.local.counters["dropped_oversize"] == 1


def test_long_prompt_truncated_to_no_labels_is_dropped_and_counted(tmp_path):
    rec = {"instruction": " ".join(["word"] * 100), "output": "yes"}
    path = write_jsonl(tmp_path / "a.jsonl", [GOOD, rec])
    cfg = make_config([{"path": str(path), "type": "alpaca"}], sequence_len=48)
    sink = StatsSink()
    rows = [r for t in iter_packed_local(cfg, sink=sink) for r in t.to_pylist()]
    assert sorted(s for r in rows for s in r["sample_ids"]) == [0]
    assert sink.local.counters["dropped_no_trained_after_truncation"] == 1


def test_empty_file(tmp_path):
    (tmp_path / "empty.jsonl").write_bytes(b"\n\n")
    write_jsonl(tmp_path / "ok.jsonl", [GOOD])
    cfg = make_config([{"path": str(tmp_path / "*.jsonl"), "type": "alpaca"}])
    with pytest.raises(BadRecordError, match=r"empty\.jsonl: empty file"):
        list(iter_packed_local(cfg))
    cfg_skip = make_config([{"path": str(tmp_path / "*.jsonl"), "type": "alpaca"}], on_bad_record="skip")
    sink = StatsSink()
    rows = [r for t in iter_packed_local(cfg_skip, sink=sink) for r in t.to_pylist()]
    assert len(rows) == 1 and sink.local.counters["skipped_bad_bytes"] == 1


def test_glob_that_matches_nothing(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", [GOOD])
    cfg = make_config([{"path": str(tmp_path / "*.parquet"), "type": "alpaca"}])
    with pytest.raises(SourceError, match=r"matched no data files"):
        build_dataset(cfg)


def test_path_that_does_not_exist(tmp_path):
    cfg = make_config([{"path": str(tmp_path / "nope.jsonl"), "type": "alpaca"}])
    with pytest.raises(SourceError, match=r"nope\.jsonl.*does not exist"):
        build_dataset(cfg)


def test_chat_template_required(tmp_path):
    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": [{"role": "user", "content": "x"}]}])
    cfg = make_config([{"path": str(path), "type": "chat_template"}], tokenizer=GPT2)
    with pytest.raises(Exception, match="has no chat template"):
        list(iter_packed_local(cfg))


# ----------------------------------------------------------------------------- through Ray


def test_error_through_ray_names_file_and_line(tmp_path, ray_local):
    path, cfg = _case_config(tmp_path, "malformed_json", "raise")
    ds = build_dataset(cfg)
    with pytest.raises(Exception) as err:
        ds.take_all()
    assert f"{path} line 2: malformed JSON" in str(err.value)


def test_skip_counts_through_ray(tmp_path, ray_local):
    path, cfg = _case_config(tmp_path, "missing_field", "skip")
    ds = build_dataset(cfg)
    rows = ds.take_all()
    report = data_report(ds)
    assert len(rows) == 1 and report["counters"]["skipped_bad_record"] == 1
    assert f"{path} line 2" in report["examples"]["skipped_bad_record"][0]
