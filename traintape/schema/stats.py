"""The stat vector: a fixed, schema-versioned list of per-tensor statistics.

Every adapter computes these on the device, in this order, for every recorded tensor:

==========  ===============================================================
mean        mean of the finite elements (NaN if there are none)
std         population standard deviation of the finite elements
min         minimum finite element (NaN if none)
max         maximum finite element (NaN if none)
l2          sqrt(sum x^2) over the finite elements (0 if none)
abs_mean    mean |x| over the finite elements (NaN if none)
zero_frac   count(x == 0) / numel over all elements (NaN if numel == 0)
nan_count   number of NaN elements
inf_count   number of +Inf or -Inf elements
==========  ===============================================================

NaN and Inf are counted, never stripped silently or allowed to poison the moments.
``numel`` lives in the tensor spec (activations: per recorded row it is implied by the
batch; see the spec's shape, whose leading ``None`` marks the batch axis).
"""

from __future__ import annotations

from typing import Final

STAT_NAMES: Final[tuple[str, ...]] = (
    "mean",
    "std",
    "min",
    "max",
    "l2",
    "abs_mean",
    "zero_frac",
    "nan_count",
    "inf_count",
)
N_STATS: Final[int] = len(STAT_NAMES)
STAT_INDEX: Final[dict[str, int]] = {name: i for i, name in enumerate(STAT_NAMES)}
