"""traintape — record what happens inside a neural network while it trains.

Framework adapters are imported on use only: ``import traintape`` imports no ML
framework. ``traintape.jax``, ``traintape.torch`` and ``traintape.tf`` load theirs.
"""

from traintape._version import __version__
from traintape.core import (
    CaptureDisabledError,
    NotAStoreError,
    Recorder,
    RecordError,
    Run,
    StoreError,
    TraintapeError,
    ValidationReport,
    open_run,
    validate,
)
from traintape.schema import SCHEMA_VERSION, STAT_NAMES, CapturePolicy, Kind, TensorSpec


def __getattr__(name: str) -> object:
    # analysis imports pandas/matplotlib lazily-heavy modules: load on first use
    if name == "compare":
        from traintape.analysis import compare

        return compare
    raise AttributeError(f"module 'traintape' has no attribute {name!r}")


__all__ = [
    "SCHEMA_VERSION",
    "STAT_NAMES",
    "CaptureDisabledError",
    "CapturePolicy",
    "Kind",
    "NotAStoreError",
    "RecordError",
    "Recorder",
    "Run",
    "StoreError",
    "TensorSpec",
    "TraintapeError",
    "ValidationReport",
    "__version__",
    "compare",
    "open_run",
    "validate",
]
