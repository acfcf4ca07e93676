"""The analysis protocol: declare what to read, then compute from one shared load.

An analysis is an object with a ``name`` and two phases (Levanter's two-phase pattern):

- ``wants(cache)``: declare the stats it reads on the shared
  :class:`~traintape.analysis._common.StatsCache` (``cache.want(kind, stat, how)``,
  ``cache.want_reducer(key, reducer)``) — nothing is read yet;
- ``compute(cache)``: return its result from the loaded cache (the stats arrays are
  read once, in row blocks, for every analysis together).

:func:`run_analyses` is the one driver: every analysis declares, the cache loads once,
then each computes, in order. ``health``, ``health_trend`` and ``anomalies`` implement it
(:class:`~traintape.analysis.health.HealthAnalysis`,
:class:`~traintape.analysis.health_trend.HealthTrendAnalysis`,
:class:`~traintape.analysis.anomalies.AnomaliesAnalysis`); the report's
:func:`~traintape.analysis.summary.summarize` runs them through it.

A new analysis: implement ``wants`` and ``compute`` (reading through the cache), give it
a ``name``, and pass it to :func:`run_analyses` — or add it to ``summarize`` to have it
in the report.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from traintape.analysis._common import ProgressCallback, StatsCache, Tracker

if TYPE_CHECKING:
    from traintape.core.reader import Run


@runtime_checkable
class Analysis(Protocol):
    """An analysis over one run's stats (module docstring)."""

    name: str

    def wants(self, cache: StatsCache) -> None:
        """Declare what :meth:`compute` reads (no reading here)."""

    def compute(self, cache: StatsCache) -> Any:
        """The result, from the loaded ``cache``."""


def run_analyses(
    run: Run,
    analyses: Sequence[Analysis],
    *,
    cache: StatsCache | None = None,
    progress: ProgressCallback | None = None,
) -> dict[str, Any]:
    """Run ``analyses`` on ``run`` with one load: each declares what it reads, the stats
    are read once (one progress unit per row block), then each computes (an analysis
    counts its own units). Returns ``{analysis.name: result}`` in order.

    Raises:
        ValueError: two analyses share a name.
    """
    names = [a.name for a in analyses]
    if len(set(names)) != len(names):
        raise ValueError(f"analyses need distinct names, got {names}")
    if cache is None:
        cache = StatsCache(run, Tracker(progress))
    for a in analyses:
        a.wants(cache)
    cache.tracker.add(cache.pending_blocks())
    cache.load()
    return {a.name: a.compute(cache) for a in analyses}


__all__ = ["Analysis", "run_analyses"]
