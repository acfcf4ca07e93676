"""traintape.schema — versioned, framework-free data models of a run store.

Pure data and validation; imports nothing else from traintape.
"""

from traintape.schema.kinds import ALL_KINDS, Kind
from traintape.schema.manifest import (
    MANIFEST_ATTR,
    CommitMark,
    Event,
    EventType,
    Manifest,
    Producer,
    Severity,
    StoreLayout,
    TensorSpec,
    WriterStats,
    manifest_json_schema,
    manifest_json_schema_text,
)
from traintape.schema.names import (
    CanonicalName,
    InvalidNameError,
    check_no_prefix_clash,
    split_name,
    validate_name,
)
from traintape.schema.policy import CapturePolicy, StepPlan
from traintape.schema.stats import (
    N_RAW,
    N_STATS,
    RAW_NAMES,
    STAT_INDEX,
    STAT_NAMES,
    finalize,
    merge,
    merge_all,
    stat_column,
)
from traintape.schema.version import (
    READABLE_MAJORS,
    SCHEMA_VERSION,
    SchemaVersionError,
    check_readable,
)

__all__ = [
    "ALL_KINDS",
    "MANIFEST_ATTR",
    "N_RAW",
    "N_STATS",
    "RAW_NAMES",
    "READABLE_MAJORS",
    "SCHEMA_VERSION",
    "STAT_INDEX",
    "STAT_NAMES",
    "CanonicalName",
    "CapturePolicy",
    "CommitMark",
    "Event",
    "EventType",
    "InvalidNameError",
    "Kind",
    "Manifest",
    "Producer",
    "SchemaVersionError",
    "Severity",
    "StepPlan",
    "StoreLayout",
    "TensorSpec",
    "WriterStats",
    "check_no_prefix_clash",
    "check_readable",
    "finalize",
    "manifest_json_schema",
    "manifest_json_schema_text",
    "merge",
    "merge_all",
    "split_name",
    "stat_column",
    "validate_name",
]
