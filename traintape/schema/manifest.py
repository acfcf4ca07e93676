"""The run manifest: the single source of truth for what a store holds.

The manifest lives in the attributes of the store's root ``zarr.json`` under the key
``"traintape"``, so plain Zarr readers see it too. It is rewritten atomically at every
commit; everything it declares up to its :class:`CommitMark` is durable.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import UTC, datetime
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)

from traintape.schema.kinds import Kind
from traintape.schema.migrate import migrate
from traintape.schema.names import (
    CanonicalName,
    check_no_prefix_clash,
    split_name,
    validate_name,
)
from traintape.schema.policy import CapturePolicy
from traintape.schema.roles import LayerKind
from traintape.schema.stats import LEGACY_STAT_NAMES, STAT_NAMES
from traintape.schema.version import SCHEMA_VERSION, parse_version

MANIFEST_ATTR = "traintape"
"""Key of the manifest inside the root group's ``attributes``."""


def _now() -> datetime:
    return datetime.now(UTC)


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Producer(_Model):
    """Who wrote the store. Excluded when comparing stores across frameworks."""

    framework: str | None = Field(None, description="'jax', 'torch', 'tensorflow' or None")
    framework_version: str | None = None
    adapter: str | None = Field(None, description="adapter entry point, e.g. 'traintape.jax'")
    traintape_version: str
    python_version: str
    hostname: str | None = None
    stats_backend: str | None = Field(
        None,
        description="where the adapter computed the stat rows: 'jax-ffi-c' (traintape's C "
        "kernel inside the XLA computation), 'xla' (XLA reductions), 'c-openmp' / 'c' "
        "(traintape's host C kernel), 'numpy' (the numpy reference), 'torch' (torch "
        "reductions on the tensors' device), 'tf' (TF reductions in the graph); None: not "
        "recorded (stores before 1.2.0, or records made without an adapter)",
    )


class StoreLayout(_Model):
    """Physical layout choices (chunking, compression); readers need not care."""

    row_chunk: int = Field(64, ge=1, description="rows per chunk of steps/stats/metrics arrays")
    row_block: int = Field(1024, ge=1, description="row axis grows by this many rows")
    snapshot_chunk_bytes: int = Field(
        128 << 10, ge=1024, description="target size of a snapshot's inner chunk"
    )
    compression: Literal["none", "zstd", "blosc"] = "none"
    stats_dtype: Literal["float64"] = "float64"
    all_chunks_stored: bool = Field(
        False,
        description="every chunk the commit mark covers is stored, even one equal to the "
        "fill value (stores written since schema 1.1.0), so validate can check that each "
        "exists; False for older stores",
    )
    bfloat16_storage: Literal["float32"] = Field(
        "float32",
        description="bfloat16 tensors are widened (losslessly) to float32 on disk, because "
        "zarr-python has no bfloat16 dtype; the spec keeps dtype='bfloat16'",
    )


class TensorSpec(_Model):
    """One recorded tensor of one kind.

    ``shape`` is the canonical shape (after ``permutation``). For activations the
    leading (batch) axis is ``None``: stat vectors are taken over the whole batch,
    and snapshots (probe batch) fix it per snapshot array.
    """

    name: CanonicalName
    kind: Kind
    role: str = Field(description="leaf role: kernel, bias, scale, embedding, running_mean, ...")
    layer: str = Field("", description="module path of the owning layer ('' at the root)")
    layer_kind: LayerKind | None = Field(
        None, description="canonical layer type: dense, conv, embedding, layer_norm, ..."
    )
    dtype: str = Field(description="numpy dtype name of the canonical tensor, e.g. 'float32'")
    shape: list[int | None]
    source_name: str | None = Field(None, description="the framework's own name")
    source_shape: list[int | None] | None = Field(None, description="the framework's layout")
    permutation: list[int] | None = Field(
        None,
        description="canonical = source.transpose(permutation); None means identity",
    )
    aliases: list[str] = Field(default_factory=list, description="other names (tied weights)")
    snapshot_shape: list[int] | None = Field(
        None, description="shape of each full snapshot (activations: the probe batch's shape)"
    )

    @classmethod
    def build(
        cls,
        name: str,
        kind: Kind | str,
        *,
        dtype: str,
        shape: Sequence[int | None],
        layer_kind: LayerKind | str | None = None,
        source_name: str | None = None,
        source_shape: Sequence[int | None] | None = None,
        permutation: Sequence[int] | None = None,
        aliases: Sequence[str] = (),
    ) -> TensorSpec:
        """The one constructor adapters use: ``layer`` and ``role`` come from the name
        (:func:`~traintape.schema.names.split_name`); for ``activation`` the leading
        (batch) axis of ``shape`` and ``source_shape`` is set to None (stat vectors are
        taken over whatever batch a step had). ``shape`` is canonical; ``source_shape``
        the framework's (None: not given); ``permutation``: canonical =
        source.transpose(permutation), None for identity."""
        kind = Kind(kind)
        layer, role = split_name(name)
        shape_l: list[int | None] = [None if d is None else int(d) for d in shape]
        src: list[int | None] | None = (
            None if source_shape is None else [None if d is None else int(d) for d in source_shape]
        )
        if kind == Kind.ACTIVATION:
            if shape_l:
                shape_l[0] = None
            if src:
                src[0] = None
        perm = None if permutation is None else [int(i) for i in permutation]
        if perm is not None and perm == list(range(len(perm))):
            perm = None
        return cls(
            name=name,
            kind=kind,
            role=role,
            layer=layer,
            layer_kind=layer_kind,  # validated against LayerKind
            dtype=dtype,
            shape=shape_l,
            source_name=source_name,
            source_shape=src,
            permutation=perm,
            aliases=list(aliases),
        )

    @property
    def numel(self) -> int | None:
        """Element count, or None when an axis (activation batch) varies."""
        n = 1
        for d in self.shape:
            if d is None:
                return None
            n *= d
        return n

    @model_validator(mode="after")
    def _check(self) -> TensorSpec:
        layer, role = split_name(self.name)
        if self.role != role:
            raise ValueError(
                f"tensor {self.name!r}: role {self.role!r} differs from the name's leaf {role!r}"
            )
        if self.layer != layer:
            raise ValueError(
                f"tensor {self.name!r}: layer {self.layer!r} differs from the name's path {layer!r}"
            )
        if self.permutation is not None:
            if sorted(self.permutation) != list(range(len(self.shape))):
                raise ValueError(
                    f"tensor {self.name!r}: permutation {self.permutation} is not a permutation "
                    f"of {len(self.shape)} axes"
                )
            if self.source_shape is not None and [
                self.source_shape[i] for i in self.permutation
            ] != list(self.shape):
                raise ValueError(
                    f"tensor {self.name!r}: source_shape {self.source_shape} permuted by "
                    f"{self.permutation} is not shape {self.shape}"
                )
        return self


class Severity(StrEnum):
    INFO = "info"
    WARNING = "warning"
    ERROR = "error"


class EventType(StrEnum):
    """traintape's own event types (users name theirs ``user/<name>``)."""

    NAN = "nan"  # first NaN of a (kind, tensor) or metric
    INF = "inf"  # first +-Inf of a (kind, tensor) or metric
    NOTE = "note"  # a remark: a user's, or traintape's (e.g. a writer claim taken over)
    REWIND = "rewind"  # resumed at an earlier step; the abandoned rows' copy is named
    SNAPSHOT_SKIPPED = "snapshot_skipped"  # a full capture skipped: over the memory budget


USER_EVENT_PREFIX = "user/"


def check_event_type(value: Any) -> EventType | str:
    """An :class:`EventType`, or ``user/<name>`` with ``<name>`` in the canonical name
    grammar; anything else raises ValueError naming the choices."""
    if isinstance(value, str):
        if value in EventType._value2member_map_:
            return EventType(value)
        if value.startswith(USER_EVENT_PREFIX):
            try:
                validate_name(value[len(USER_EVENT_PREFIX) :])
                return value
            except ValueError:
                pass
    raise ValueError(
        f"event type {value!r} is not one of traintape's ({', '.join(t.value for t in EventType)}); "
        f"name your own {USER_EVENT_PREFIX}<name>, e.g. {USER_EVENT_PREFIX}lr_drop"
    )


class Event(_Model):
    """Something noticed at write time (NaN/Inf first seen, a note from the user)."""

    step: int = Field(ge=0)
    type: Annotated[EventType | str, BeforeValidator(check_event_type)] = Field(
        description="one of traintape's EventType values, or 'user/<name>' for a user's own"
    )
    severity: Severity = Severity.INFO
    tensor: str | None = None
    kind: Kind | None = None
    message: str = ""
    data: dict[str, float | int | str] = Field(default_factory=dict)


class CommitMark(_Model):
    """How much of the store is complete. Readers never look past it."""

    rows: int = Field(0, ge=0, description="number of complete rows in steps/stats/metrics")
    snapshots: dict[Kind, int] = Field(
        default_factory=dict, description="complete snapshots per kind"
    )
    last_step: int | None = Field(None, description="step of the last committed row")
    sequence: int = Field(0, ge=0, description="incremented at every commit")


class WriterStats(_Model):
    """How the asynchronous writer fared; stalls are time the training thread waited."""

    stalls: int = 0
    stall_seconds: float = 0.0
    commits: int = 0
    disabled: bool = False
    error: str | None = None


class Manifest(_Model):
    """Schema v1 run manifest."""

    format: Literal["traintape"] = "traintape"
    schema_version: str = SCHEMA_VERSION
    run_id: str
    created_at: datetime = Field(default_factory=_now)
    updated_at: datetime = Field(default_factory=_now)
    status: Literal["open", "closed", "failed"] = "open"
    producer: Producer
    policy: CapturePolicy = Field(default_factory=CapturePolicy)
    stat_names: list[str] = Field(default_factory=lambda: list(STAT_NAMES))
    layout: StoreLayout = Field(default_factory=StoreLayout)
    tensors: list[TensorSpec] = Field(
        default_factory=list,
        description="ordered by (kind, name); per kind, the order of the stats tensor axis",
    )
    metrics: list[CanonicalName] = Field(default_factory=list)
    events: list[Event] = Field(default_factory=list)
    commit: CommitMark = Field(default_factory=CommitMark)
    writer: WriterStats = Field(default_factory=WriterStats)
    forward_order: list[str] | None = Field(
        None,
        description="layer paths (or tensor names) in the order the forward pass runs them, "
        "when the adapter knows it (Linen, torch, Keras) or the user gives it; a hint for "
        "ordering analyses, not content (compare does not count it as a difference)",
    )
    user: dict[str, Any] = Field(default_factory=dict, description="free-form run metadata")

    @model_validator(mode="before")
    @classmethod
    def _migrate(cls, data: Any) -> Any:
        data = migrate(data)
        if isinstance(data, dict) and isinstance(data.get("user"), dict):
            user = data["user"]
            if "forward_order" in user and data.get("forward_order") is None:
                user = dict(user)  # user=dict(forward_order=...) is the typed field
                data = {**data, "user": user, "forward_order": user.pop("forward_order")}
        return data

    @field_validator("schema_version")
    @classmethod
    def _version(cls, v: str) -> str:
        parse_version(v)
        return v

    @field_validator("stat_names")
    @classmethod
    def _stats(cls, v: list[str]) -> list[str]:
        if tuple(v) != STAT_NAMES and tuple(v) not in LEGACY_STAT_NAMES:
            raise ValueError(
                f"stat_names {v} differ from the schema v1 stat vector {list(STAT_NAMES)} "
                f"(or an older version's: {[list(x) for x in LEGACY_STAT_NAMES]})"
            )
        return v

    @model_validator(mode="after")
    def _check(self) -> Manifest:
        seen: set[tuple[Kind, str]] = set()
        for spec in self.tensors:
            key = (spec.kind, spec.name)
            if key in seen:
                raise ValueError(f"tensor {spec.name!r} of kind {spec.kind} declared twice")
            seen.add(key)
        for kind in Kind:
            names = self.tensor_names(kind)
            if names != sorted(names):
                raise ValueError(f"tensors of kind {kind} are not in sorted canonical order")
            check_no_prefix_clash(names)
        check_no_prefix_clash(list(self.metrics))
        return self

    def tensor_names(self, kind: Kind | str | None = None) -> list[str]:
        """Canonical names of one kind in stats-axis order (all kinds: unique, sorted)."""
        if kind is None:
            return sorted({s.name for s in self.tensors})
        return [s.name for s in self.tensors if s.kind == Kind(kind)]

    def specs(self, kind: Kind | str) -> list[TensorSpec]:
        return [s for s in self.tensors if s.kind == Kind(kind)]

    def spec(self, name: str, kind: Kind | str) -> TensorSpec:
        for s in self.tensors:
            if s.name == name and s.kind == Kind(kind):
                return s
        raise KeyError(f"no tensor {name!r} of kind {Kind(kind).value} in this run")

    def kinds(self) -> list[Kind]:
        """Kinds that have at least one declared tensor, in schema order."""
        present = {s.kind for s in self.tensors}
        return [k for k in Kind if k in present]


def manifest_json_schema() -> dict[str, Any]:
    """JSON Schema of :class:`Manifest`, generated from the models (never hand-written)."""
    schema = Manifest.model_json_schema(mode="serialization")
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["$id"] = f"https://traintape.dev/schema/{SCHEMA_VERSION}/manifest.schema.json"
    return schema


def manifest_json_schema_text() -> str:
    return json.dumps(manifest_json_schema(), indent=2, sort_keys=True) + "\n"
