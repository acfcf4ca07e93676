"""Known, reported adapter gaps that make conformance cells differ.

Each entry names the adapter, what differs and why; ``tests/test_conformance.py``
turns the affected cells into *strict* xfails, so fixing the adapter makes the test
XPASS (and fail) until the entry is deleted here. Keep this list empty when you can.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Gap:
    frameworks: tuple[str, ...]
    models: tuple[str, ...] | None
    """None: every model."""
    dtypes: tuple[str, ...]
    reason: str
    within: bool = False
    """True: also cells between two of ``frameworks`` differ (e.g. the worker fails)."""


KNOWN_GAPS: tuple[Gap, ...] = ()
"""Empty: every cell of the matrix is identical. (The last entry, equinox ``gru``, went
when the equinox GRU was written out with PyTorch's four parameters, as the Flax ones
are: ``eqx.nn.GRUCell``'s single r/z bias cannot hold torch's two;
conformance/README.md.)"""


def known_gap(dtype: str, model: str, a: str, b: str) -> str | None:
    """The reason cell (dtype[+optimizer], model, a ↔ b) is expected to differ, or None."""
    dtype = dtype.partition("+")[0]
    for g in KNOWN_GAPS:
        if dtype not in g.dtypes or (g.models is not None and model not in g.models):
            continue
        ina, inb = a in g.frameworks, b in g.frameworks
        if (ina != inb) or (g.within and ina and inb):
            return g.reason
    return None
