"""Resuming the data position: a saved :class:`DataState` against the run's :class:`StreamSpec`.

A position is only meaningful for the stream it was taken in: the state carries that stream's
fingerprint (:func:`pipelines.stream.spec.stream_fingerprint`), and :func:`resume_state` compares it with
the spec's. Equal: the state resumes as saved. Different: ``run.on_data_change`` decides.

* ``fail`` (the default): refused before training, naming each change (``data.sequence_len: 512 -> 256``).
* ``restart``: the weights stay and the data restarts at the start of the checkpoint's epoch;
  samples already trained on this epoch may repeat. The ledger records it (``restart_<step>.json``).
* ``continue``: for a change of the mix only -- datasets added, removed or reweighted. Every source
  that is still there keeps its exactly-once position, a new source starts at its beginning, a removed
  one stops, and the new weights apply from the resume step (the mixing counters start again from zero,
  so the mix is token-weighted from there on). Anything else that changed (a source's own files or
  options, the tokenizer, ``sequence_len``, ...) is refused as under ``fail``. The ledger records the
  change (``change_<step>.json``). Worked example: a run of ``a`` (weight 1) checkpointed at step 40
  mid-epoch, resumed with ``a`` (0.5) and ``b`` (0.5)::

      saved    sources [a @ file 3, unit 2000, 1 row done; tokens 81,920]
      resumed  sources [a @ file 3, unit 2000, 1 row done; tokens 0], [b @ its start; tokens 0]
      ledger   change_00000040.json: ["data.datasets[1].path: (unset) -> 'b.jsonl'", ..., "b.jsonl: added"]

  Sources are matched by key (``data.datasets[].name``, else the path as written). A source's sample ids
  depend on where its files sit in the listing, so datasets are added after the existing ones.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from pipelines.seeds import stream_epoch
from pipelines.stream.spec import StreamSpec, fingerprint_changes
from pipelines.stream.state import DataState, DataStateError, SourceState
from pipelines.stream.units import ResumePoint

__all__ = ["DataChangeError", "Resumed", "fresh_state", "resume_state", "state_problem"]

OnChange = Literal["fail", "restart", "continue"]


class DataChangeError(DataStateError):
    """The saved position cannot continue this stream under ``run.on_data_change``; the message says what changed."""


@dataclass(frozen=True)
class Resumed:
    """What a resume starts from: ``state`` (``None``: a fresh start), and when the data did not resume
    as saved, ``kind`` (``restart`` | ``continue``), the lines that say what changed, and a banner to print."""

    state: DataState | None
    kind: str = ""
    changes: tuple[str, ...] = ()
    banner: str = ""


def fresh_state(spec: StreamSpec, epoch: int = 0, step: int = 0) -> DataState:
    """The position at the start of ``epoch``: every source at its beginning."""
    sources = [SourceState(point=ResumePoint(epoch=stream_epoch(epoch, 0)), key=s.key, identity=s.identity)
               for s in spec.sources]
    return DataState(epoch, step, sources, fingerprint=dict(spec.fingerprint))


def state_problem(saved: dict | None, step: int, fingerprint: dict) -> str | None:
    """Why ``saved`` (a checkpoint's data state at ``step``) cannot resume the stream of ``fingerprint`` as
    saved, or ``None`` when it can."""
    if not saved:
        return None if step == 0 else f"the checkpoint at step {step} has no data position"
    try:
        state = DataState.from_dict(saved)
    except DataStateError as err:
        return str(err)
    assert state is not None
    if not state.fingerprint:
        return "the data position has no fingerprint of its stream"
    changes = fingerprint_changes(state.fingerprint, fingerprint)
    if changes:
        return "the training stream changed since the checkpoint: " + "; ".join(changes)
    return None


def _refusal(problem: str, where: str) -> str:
    return (f"cannot resume the data position of {where}: {problem}. Continuing would train on a different "
            "stream than the ledger and the saved position describe. Undo the change; or, for datasets added, "
            "removed or reweighted, set run.on_data_change=continue; or set run.on_data_change=restart to keep "
            "the weights and restart the data at the start of the current epoch; or run.resume=never / a new "
            "run.name to start over.")


def _is_mix_key(key: str) -> bool:
    return key.startswith("data.datasets[") or key == "files"


def _datasets_in(fingerprint: dict) -> int:
    return len({k.split("]")[0] for k in fingerprint if k.startswith("data.datasets[")})


def _continued(saved: DataState, spec: StreamSpec, where: str) -> tuple[DataState, list[str]]:
    """``saved`` carried over to the mix of ``spec`` (see the module docstring), and what changed."""
    old, new = saved.fingerprint, spec.fingerprint
    other = fingerprint_changes({k: v for k, v in old.items() if not _is_mix_key(k)},
                                {k: v for k, v in new.items() if not _is_mix_key(k)})
    if other:
        raise DataChangeError(_refusal("run.on_data_change=continue carries positions across datasets added, "
                                       "removed or reweighted only, and this also changed: " + "; ".join(other), where))
    single = [fp for fp in (old, new) if fp.get("data.mix_by") == "none" and _datasets_in(fp) > 1]
    if single:
        raise DataChangeError(_refusal("data.mix_by=none streams every dataset as one, so a change in them is a "
                                       "change of that stream; continue needs data.mix_by tokens or samples", where))
    if any(not s.key for s in saved.sources):
        raise DataChangeError(_refusal("the saved position predates per-source keys (written by an older version)",
                                       where))
    changes = fingerprint_changes({k: v for k, v in old.items() if _is_mix_key(k)},
                                  {k: v for k, v in new.items() if _is_mix_key(k)})
    before = {s.key: s for s in saved.sources}
    sources: list[SourceState] = []
    for src in spec.sources:
        prev = before.pop(src.key, None)
        if prev is None:
            changes.append(f"{src.key}: added at weight {src.weight:g}, from its start")
            sources.append(SourceState(point=ResumePoint(epoch=stream_epoch(saved.epoch, 0)), key=src.key,
                                       identity=src.identity))
        elif prev.identity != src.identity:
            raise DataChangeError(_refusal(
                f"source {src.key!r} is not the stream it was (its files, their place in the listing, or its "
                "options changed); continue keeps the position of unchanged sources only (add datasets after "
                "the existing ones, or give a changed source a new name)", where))
        else:
            sources.append(replace(prev, tokens=0, samples=0))  # the new weights apply from here
    changes += [f"{key}: removed" for key in before]
    if saved.epoch_done:  # the next epoch starts every source fresh anyway
        sources = []
    return DataState(saved.epoch, saved.step, sources, saved.epoch_done, dict(new)), changes


def resume_state(saved: dict | None, step: int, epoch: int, spec: StreamSpec, on_change: OnChange,
                 where: str) -> Resumed:
    """The position to resume the stream of ``spec`` from, given a checkpoint's data state ``saved`` taken at
    ``step`` in ``epoch``; ``where`` names the checkpoint in messages. Raises :class:`DataChangeError` when
    ``on_change`` does not allow what changed. Writes nothing (the feeder records restarts and changes)."""
    problem = state_problem(saved, step, spec.fingerprint)
    if problem is None:
        return Resumed(DataState.from_dict(saved))
    if on_change == "continue" and saved:
        try:
            state = DataState.from_dict(saved)
        except DataStateError as err:
            raise DataChangeError(_refusal(str(err), where)) from None
        if state is not None and state.fingerprint:
            continued, changes = _continued(state, spec, where)
            banner = (f"DATA CHANGE (run.on_data_change=continue) at step {step}: " + "; ".join(changes)
                      + ". Unchanged sources keep their positions; the weights apply from here.")
            return Resumed(continued, "continue", tuple(changes), banner)
    if on_change == "fail" or on_change == "continue":
        raise DataChangeError(_refusal(problem, where))
    banner = (f"DATA RESTART (run.on_data_change=restart): {problem}. Keeping the weights of step {step}; "
              f"the data restarts at the start of epoch {epoch}; samples already trained on may repeat.")
    return Resumed(DataState.restart(epoch, step, spec.fingerprint), "restart", (problem,), banner)
