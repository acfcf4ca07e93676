"""traintape.core — the framework-free engine (numpy only).

:class:`Recorder` writes a run store, :func:`open_run` reads one, :func:`validate`
checks one. Knows no ML framework.
"""

from traintape.core.errors import (
    CaptureDisabledError,
    NotAStoreError,
    RecordError,
    StoreError,
    TraintapeError,
)
from traintape.core.reader import Run, open_run
from traintape.core.recorder import KindRows, Recorder
from traintape.core.stats import stat_vector, stat_vectors
from traintape.core.store import read_manifest
from traintape.core.validate import ValidationReport, validate

__all__ = [
    "CaptureDisabledError",
    "KindRows",
    "NotAStoreError",
    "RecordError",
    "Recorder",
    "Run",
    "StoreError",
    "TraintapeError",
    "ValidationReport",
    "open_run",
    "read_manifest",
    "stat_vector",
    "stat_vectors",
    "validate",
]
