"""Errors that several stages raise, on the ground floor so that no stage imports another for one class."""

from __future__ import annotations

__all__ = ["BadRecordError", "RecordError"]


class RecordError(ValueError):
    """A record that cannot be formatted; the message says why (the caller adds where)."""


class BadRecordError(ValueError):
    """A record that cannot be used; the message names the file and line/row."""
