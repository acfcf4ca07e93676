"""Schema versioning: which store versions this build writes and reads."""

from __future__ import annotations

from typing import Final

SCHEMA_VERSION: Final[str] = "1.4.0"
"""Semver of the store format this build writes (older 1.x manifests are migrated on
read: :mod:`traintape.schema.migrate`)."""

READABLE_MAJORS: Final[tuple[int, ...]] = (1,)
"""Major versions this build reads (older majors would be migrated here)."""


class SchemaVersionError(ValueError):
    """The store was written by a schema version this build cannot read."""


def parse_version(version: str) -> tuple[int, int, int]:
    """Parse ``MAJOR.MINOR.PATCH``; raise ValueError naming the bad string."""
    parts = version.split(".")
    if len(parts) != 3 or not all(p.isdigit() for p in parts):
        raise ValueError(f"schema_version {version!r} is not MAJOR.MINOR.PATCH")
    major, minor, patch = (int(p) for p in parts)
    return major, minor, patch


def check_readable(version: str) -> None:
    """Raise :class:`SchemaVersionError` unless this build can read ``version``."""
    major = parse_version(version)[0]
    if major not in READABLE_MAJORS:
        readable = ", ".join(f"{m}.x" for m in READABLE_MAJORS)
        newer = (
            " (newer than this build: upgrade traintape)" if major > max(READABLE_MAJORS) else ""
        )
        raise SchemaVersionError(
            f"store schema version {version}{newer}; this build of traintape reads schema {readable}"
        )
