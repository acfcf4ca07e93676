"""User checks and metrics: plain functions over a run, shown by ``health`` and the report.

A check (or a metric: a check that only measures) is a function ``fn(run) -> CheckResult``
over an open :class:`~traintape.core.reader.Run`. Register it with the decorator::

    from traintape.analysis.registry import CheckIssue, CheckResult, check

    @check("weight_norm_cap", description="no parameter's L2 norm above 100")
    def weight_norm_cap(run):
        df = run.stats("param")  # one row per (step, tensor), a column per stat
        last = df[df.step == df.step.max()].set_index("tensor")["l2"]
        return CheckResult(
            values=last.to_dict(),
            issues=[CheckIssue(severity="warning", layer=name, message=f"L2 norm {v:.3g}",
                               recommendation="add weight decay")
                    for name, v in last.items() if v > 100],
        )

or ship it in a package, under the entry-point group ``traintape.checks``
(``[project.entry-points."traintape.checks"] weight_norm_cap = "mypkg.checks:weight_norm_cap"``):
the entry point's name is the check's name, its object the function (an object already
registered by the decorator when its module was imported is not registered twice; a
module, whose import registers its checks with the decorator, is accepted too). Entry
points are loaded once, the first time checks are run (:func:`load_entry_points`);
``TRAINTAPE_NO_PLUGINS=1`` skips them.

:func:`run_checks` runs every registered check (in registration order) and never raises
for a check: a check that raises, or returns something other than a :class:`CheckResult`
(a ``dict`` of its fields is accepted), and an entry point that cannot be loaded, give a
:class:`CheckResult` with ``error`` set and status ``error``. :func:`traintape.analysis.health`
runs them (:attr:`HealthReport.checks`; their issues count towards the run's status, not
its score), and so do ``traintape health`` (a table; ``--json``) and the HTML and
Markdown reports.
"""

from __future__ import annotations

import importlib.metadata
import inspect
import os
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, TypeVar, overload

from pydantic import BaseModel, Field, ValidationError, computed_field

from traintape.analysis.issues import Issue

if TYPE_CHECKING:
    from traintape.core.reader import Run

ENTRY_POINT_GROUP = "traintape.checks"
"""The entry-point group whose entries are checks (see the module docstring)."""

CheckSeverity = Literal["info", "warning", "critical"]
CheckKind = Literal["check", "metric", "rule"]
CheckStatus = Literal["healthy", "warning", "critical", "error"]


CheckIssue = Issue
"""A check's finding: the one :class:`~traintape.analysis.issues.Issue` model (``type``
defaults to the check's name)."""


class CheckResult(BaseModel):
    """What a check or metric returns (``name`` and ``kind`` are filled in by
    :func:`run_checks`)."""

    name: str = ""
    kind: Literal["check", "metric"] = "check"
    description: str = ""
    value: float | None = Field(None, description="one run-level number, if any")
    values: dict[str, float | None] = Field(
        default_factory=dict, description="per layer (or tensor) values, if any"
    )
    unit: str = ""
    issues: list[CheckIssue] = Field(default_factory=list)
    error: str | None = Field(None, description="the check failed: why (it has no result)")
    seconds: float = Field(0.0, description="time the check took")

    @computed_field  # type: ignore[prop-decorator]
    @property
    def status(self) -> CheckStatus:
        """``error`` if it failed, else the most severe of its issues (``info`` issues
        count as healthy)."""
        if self.error is not None:
            return "error"
        sev = {i.severity for i in self.issues}
        return "critical" if "critical" in sev else "warning" if "warning" in sev else "healthy"


CheckFn = Callable[["Run"], "CheckResult | dict[str, Any]"]
F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class Check:
    """A registered check."""

    name: str
    fn: Callable[..., Any]
    kind: CheckKind = "check"
    description: str = ""
    source: str = "decorator"
    """``decorator``, ``entry point <value>`` or ``built-in``."""
    thresholds: tuple[str, ...] = ()
    """A built-in rule's thresholds (fields of ``HealthThresholds``, ``-t NAME=VALUE``)."""
    scope: Literal["run", "window", "both"] = "both"
    """A built-in rule: judged over the whole run, per window of health over time, or both."""


_REGISTRY: dict[str, Check] = {}
_RULES: dict[str, Check] = {}
"""The built-in health rules (kind ``rule``): registered by :func:`register` like user
checks, kept apart so that user-check registries (and tests that swap them) never drop
them; :func:`traintape.analysis.health` runs them on its measures, not on the run."""
_LOAD_ERRORS: dict[str, str] = {}  # entry point name → why it could not be loaded
_loaded = False


def _describe(fn: Callable[..., Any], description: str | None) -> str:
    if description is not None:
        return description
    doc = inspect.getdoc(fn) or ""
    return doc.strip().splitlines()[0] if doc.strip() else ""


def register(
    fn: Callable[..., Any],
    name: str | None = None,
    *,
    kind: CheckKind = "check",
    description: str | None = None,
    replace: bool = True,
    source: str = "decorator",
    thresholds: tuple[str, ...] = (),
    scope: Literal["run", "window", "both"] = "both",
) -> Check:
    """Register ``fn(run) -> CheckResult`` under ``name`` (default: its ``__name__``).

    ``description`` defaults to the first line of its docstring. A name registered again
    replaces the earlier check (``replace=False``: raises :class:`ValueError` instead).

    Raises:
        TypeError: ``fn`` is not callable.
        ValueError: ``name`` is empty, or taken and ``replace`` is false.
    """
    if not callable(fn):
        raise TypeError(f"a check must be a function run(run) -> CheckResult, got {fn!r}")
    name = name if name is not None else getattr(fn, "__name__", "")
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"a check needs a non-empty name, got {name!r}")
    table = _RULES if kind == "rule" else _REGISTRY
    if not replace and name in table and table[name].fn is not fn:
        raise ValueError(f"a {kind} named {name!r} is already registered")
    c = Check(name=name, fn=fn, kind=kind, description=_describe(fn, description),
              source=source, thresholds=tuple(thresholds), scope=scope)  # fmt: skip
    table[name] = c
    return c


def rule(
    name: str,
    *,
    thresholds: tuple[str, ...] = (),
    scope: Literal["run", "window", "both"] = "both",
) -> Callable[[F], F]:
    """Decorator registering a built-in health rule ``fn(ctx) -> list[Issue]`` (``ctx``:
    :class:`~traintape.analysis.health_rules.RuleContext`) under ``name``, with the
    threshold names it reads; its docstring says what it detects and names the corpus
    cases that justify the thresholds. Returns the function unchanged."""

    def deco(fn: F) -> F:
        register(fn, name, kind="rule", source="built-in", thresholds=thresholds, scope=scope)
        return fn

    return deco


def rules() -> dict[str, Check]:
    """The registered built-in health rules by name, in registration order."""
    return dict(_RULES)


@overload
def check(name: F, /) -> F: ...
@overload
def check(
    name: str | None = None,
    *,
    description: str | None = None,
    kind: Literal["check", "metric"] = "check",
) -> Callable[[F], F]: ...
def check(
    name: Any = None,
    *,
    description: str | None = None,
    kind: Literal["check", "metric"] = "check",
) -> Any:
    """Decorator registering a check: ``@check``, ``@check("name")`` or
    ``@check("name", description="...")``. Returns the function unchanged."""
    if callable(name):  # bare @check
        register(name, kind=kind, description=description)
        return name

    def deco(fn: F) -> F:
        register(fn, name, kind=kind, description=description)
        return fn

    return deco


def metric(name: str | None = None, *, description: str | None = None) -> Callable[[F], F]:
    """Decorator registering a metric (a check that measures: ``value``/``values``,
    usually no issues): ``@metric("name")``."""
    return check(name, description=description, kind="metric")


def unregister(name: str) -> None:
    """Remove the check ``name`` (no error if there is none)."""
    _REGISTRY.pop(name, None)
    _LOAD_ERRORS.pop(name, None)


def registered() -> dict[str, Check]:
    """The registered checks by name, in registration order (entry points loaded)."""
    load_entry_points()
    return dict(_REGISTRY)


def load_entry_points(*, force: bool = False) -> dict[str, str]:
    """Load the checks of the entry-point group :data:`ENTRY_POINT_GROUP` (once; again
    with ``force``). Returns ``{entry point name: error}`` of those that failed to load;
    they are reported by :func:`run_checks` as failed checks. ``TRAINTAPE_NO_PLUGINS=1``
    loads none."""
    global _loaded
    if _loaded and not force:
        return dict(_LOAD_ERRORS)
    _loaded = True
    _LOAD_ERRORS.clear()
    if os.environ.get("TRAINTAPE_NO_PLUGINS"):
        return {}
    try:
        eps = list(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP))
    except Exception as e:  # a broken distribution's metadata
        _LOAD_ERRORS[f"<{ENTRY_POINT_GROUP}>"] = f"cannot list entry points: {_err(e)}"
        return dict(_LOAD_ERRORS)
    for ep in eps:
        try:
            obj = ep.load()
        except Exception as e:
            _LOAD_ERRORS[ep.name] = f"cannot load entry point {ep.name} = {ep.value}: {_err(e)}"
            continue
        if inspect.ismodule(obj):  # its import registered its checks
            continue
        if any(c.fn is obj for c in _REGISTRY.values()):
            continue
        if not callable(obj):
            _LOAD_ERRORS[ep.name] = (
                f"entry point {ep.name} = {ep.value} is {type(obj).__name__}, not a function"
            )
            continue
        register(obj, ep.name, source=f"entry point {ep.value}")
    return dict(_LOAD_ERRORS)


def _err(e: BaseException) -> str:
    first = str(e).splitlines()[0] if str(e) else ""
    return f"{type(e).__name__}: {first}" if first else type(e).__name__


def _where(e: BaseException, fn: Callable[..., Any]) -> str:
    """`` (at file:line)``: the innermost frame of ``e``'s traceback in the check's own
    file (else the innermost frame)."""
    tb = traceback.extract_tb(e.__traceback__)
    if not tb:
        return ""
    code = getattr(fn, "__code__", None)
    own = [f for f in tb if code is not None and f.filename == code.co_filename]
    f = (own or tb)[-1]
    return f" (at {os.path.basename(f.filename)}:{f.lineno})"


def run_check(run: Run, c: Check) -> CheckResult:
    """Run one check; a failure becomes the result's ``error`` (never raised)."""
    t0 = time.perf_counter()
    try:
        out = c.fn(run)
    except Exception as e:
        out = CheckResult(error=_err(e) + _where(e, c.fn))
    try:
        if isinstance(out, dict):
            out = CheckResult.model_validate(out)
        if isinstance(out, CheckResult):
            res = out.model_copy(deep=True)
        else:
            res = CheckResult(error=f"returned {type(out).__name__}, expected a CheckResult")
    except ValidationError as e:
        res = CheckResult(error=f"returned an invalid result: {_err(e)}")
    res.name, res.kind = c.name, ("metric" if c.kind == "metric" else "check")
    for i in res.issues:
        if i.type == "CHECK":
            i.type = c.name
    res.description = res.description or c.description
    res.seconds = time.perf_counter() - t0
    return res


def run_checks(run: Run, names: list[str] | None = None) -> list[CheckResult]:
    """Run the registered checks (or those of ``names``) on ``run``, in registration
    order, then one failed result per entry point that could not be loaded.

    Raises:
        KeyError: a name of ``names`` is not registered (the message lists those that are).
    """
    load_entry_points()
    checks = list(_REGISTRY.values())
    if names is not None:
        unknown = [n for n in names if n not in _REGISTRY]
        if unknown:
            raise KeyError(
                f"no check named {unknown[0]!r}; registered: {', '.join(_REGISTRY) or 'none'}"
            )
        checks = [_REGISTRY[n] for n in names]
    out = [run_check(run, c) for c in checks]
    if names is None:
        out += [CheckResult(name=n, error=msg) for n, msg in _LOAD_ERRORS.items()]
    return out


def worst(results: list[CheckResult]) -> Literal["healthy", "warning", "critical"]:
    """The most severe issue over ``results`` (failed checks do not count)."""
    st = {r.status for r in results}
    return "critical" if "critical" in st else "warning" if "warning" in st else "healthy"


__all__ = [
    "ENTRY_POINT_GROUP",
    "Check",
    "CheckIssue",
    "CheckResult",
    "check",
    "load_entry_points",
    "metric",
    "register",
    "registered",
    "rule",
    "rules",
    "run_check",
    "run_checks",
    "unregister",
    "worst",
]
