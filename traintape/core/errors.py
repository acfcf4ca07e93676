"""Errors raised by traintape's engine. Each names the thing at fault."""

from __future__ import annotations

from traintape.schema.names import InvalidNameError


class TraintapeError(Exception):
    """Base class of traintape errors."""


class StoreError(TraintapeError):
    """The store location cannot be used (unwritable, foreign, corrupt)."""


class NotAStoreError(StoreError):
    """The path holds no traintape store."""


class RecordError(TraintapeError, ValueError):
    """A record call was given bad input (wrong step, shape, dtype or tensor set)."""


class CaptureDisabledError(TraintapeError):
    """Capture was disabled after a storage failure (raised only with ``strict=True``)."""


class RecordNameError(RecordError, InvalidNameError):
    """A record call used a name that breaks the canonical grammar (both a
    :class:`RecordError` and the schema's :class:`~traintape.schema.InvalidNameError`)."""
