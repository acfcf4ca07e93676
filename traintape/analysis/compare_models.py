"""The result models of ``compare`` (:mod:`traintape.analysis.compare`)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

from traintape.analysis.compare_numerics import Precision


class Tolerance(BaseModel):
    atol: float
    rtol: float


class StructuralDiff(BaseModel):
    """One structural difference (``what``: 'tensor', 'kind', 'spec', 'steps', 'snapshots',
    'metrics', 'manifest', 'rows')."""

    what: str
    kind: str | None = None
    tensor: str | None = None
    field: str | None = None
    a: Any = None
    b: Any = None
    message: str


class TensorDiff(BaseModel):
    """Numeric comparison of one tensor of one kind (or one metric, kind ``metrics``).

    Every number is named by the statistic behind it (``*_stat``; ``'snapshot'`` for an
    element of a full snapshot, ``'value'`` for a metric)."""

    tensor: str
    kind: str
    steps_compared: int = 0
    snapshots_compared: int = 0
    max_abs: float | None = Field(None, description="max |a − b| over stats and snapshots")
    worst_stat: str | None = Field(None, description="stat (or 'snapshot') of the max_abs")
    max_rel: float | None = Field(
        None,
        description="max |a − b| / |b| where the relative part of the tolerance dominates "
        "(rtol·|b| >= atol: elsewhere b is within the absolute tolerance of 0)",
    )
    max_rel_stat: str | None = Field(None, description="stat of the max_rel")
    max_tol_ratio: float | None = Field(
        None, description="max |a − b| / tolerance over the judged entries (> 1: out)"
    )
    max_tol_ratio_stat: str | None = None
    min_cosine: float | None = Field(None, description="lowest snapshot cosine similarity")
    first_step_out: int | None = Field(None, description="first step leaving tolerance")
    first_out_via: str | None = Field(None, description="stat or 'snapshot' that left it")
    first_out_a: float | None = Field(None, description="run A's value there")
    first_out_b: float | None = Field(None, description="run B's value there")
    first_out_tol: float | None = Field(None, description="the |a − b| allowed there")
    within: bool = True
    atol: float = Field(description="the kind's base atol (per-step values: see numerics)")
    rtol: float
    noise_floor: float | None = Field(
        None, description="largest noise floor (l2) this tensor was held to over the steps"
    )
    steps_within_noise: int = Field(
        0, description="steps at which the tensor was within noise in both runs (equal)"
    )
    steps_one_sided: int = Field(
        0, description="steps recorded for this tensor in one run only (not compared)"
    )


class KindNumerics(BaseModel):
    """The numbers one kind was judged with (ranges over the compared steps)."""

    kind: str
    global_norm: tuple[float, float] | None = Field(None, description="min, max of G_k(t)")
    noise_floor: tuple[float, float] | None = Field(None, description="min, max floor")
    atol: tuple[float, float] | None = Field(None, description="min, max base atol")
    rtol: tuple[float, float] | None = Field(None, description="min, max rtol")
    max_gain: float | None = Field(None, description="update: largest optimizer gain used")
    gain_from: str | None = Field(None, description="update: 'opt_state' or 'grad'")
    tensors_within_noise: list[str] = Field(
        default_factory=list, description="tensors within noise at some step"
    )


class CompareReport(BaseModel):
    a: str
    b: str
    identical: bool
    verdict: str = Field(description="'identical' or 'differs'")
    mode: str = Field(
        "shared",
        description="'shared': the verdict judges the data both runs hold; 'strict': the "
        "stores must also be identical in structure",
    )
    structural: list[StructuralDiff] = Field(
        default_factory=list, description="structural differences that make the runs differ"
    )
    not_compared: list[StructuralDiff] = Field(
        default_factory=list,
        description="what only one run holds (shared mode; in strict mode these are "
        "structural differences)",
    )
    notes: list[str] = Field(default_factory=list)
    tensors: list[TensorDiff] = Field(default_factory=list)
    first_divergence: TensorDiff | None = None
    tolerances: dict[str, Tolerance]
    common_steps: int = 0
    precision: Precision | None = Field(None, description="the precision assumed, and why")
    numerics: dict[str, KindNumerics] = Field(
        default_factory=dict, description="per kind: global norms, noise floors, tolerances"
    )
    excluded: list[str] = Field(
        default_factory=list, description="tensors and metrics left out by --exclude"
    )
    explain: list[str] = Field(
        default_factory=list, description="the rules and numbers used, as text"
    )

    def diff(self, tensor: str, kind: str) -> TensorDiff:
        for t in self.tensors:
            if t.tensor == tensor and t.kind == kind:
                return t
        raise KeyError((tensor, kind))
