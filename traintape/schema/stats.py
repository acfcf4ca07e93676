"""The stat vector and its algebra — the one place where statistics are defined.

Every backend (traintape's C kernel, XLA reductions, TensorFlow ops, torch ops) reduces
a tensor to a **raw row**: the mergeable sufficient statistics of :data:`RAW_FIELDS`,
float64, in that order. Raw rows of disjoint parts of one tensor (shards on devices or
processes, micro-batches of a step) combine *exactly* with :func:`merge` — sums add,
min/max take the extreme, ``m2`` uses Chan's parallel formula, a part held in scaled
units (``exp``, :data:`SCALED`) is first rescaled to the other's — and :func:`finalize`
turns raw rows into the **stat vector** (:data:`STATS`), the per-tensor statistics a
store holds (``stats/<kind>`` arrays, last axis in :data:`STAT_NAMES` order).

==========  ===============================================================
mean        mean of the finite elements (NaN if there are none)
std         population standard deviation of the finite elements (NaN if none)
min         minimum finite element (NaN if none)
max         maximum finite element (NaN if none)
l2          sqrt(sum x^2) over the finite elements (0 if none)
abs_mean    mean |x| over the finite elements (NaN if none)
zero_frac   count(x == 0) / numel over all elements (NaN if numel == 0)
nan_count   number of NaN elements
inf_count   number of +Inf or -Inf elements
sig         layout signature: sum s(c) x_c / l2 over the finite elements, ``s`` a fixed
            pseudo-random ±1 pattern of the canonical flat index ``c``
            (:func:`pattern_sign`; 0 if l2 is 0, NaN if there are none)
==========  ===============================================================

``sig`` is the one statistic that depends on *where* each value sits: every other one is
invariant under any permutation of the elements, so without it a stats-only comparison
cannot see a transposed square kernel or swapped attention heads or LSTM gates. The
pattern is a function of the element's index in the **canonical** layout (row-major, mod
2**32), whatever layout a backend holds the tensor in: backends are given an
:class:`IndexMap` (the canonical index of each element of the array they reduce; see
:func:`index_map`) for tensors held permuted, for a part of a tensor (a shard or row
block: the part's offset) and for activations, whose batch axis has stride 0 — the
pattern runs over the per-example index, so every example sees the same pattern and
batch splits (micro-batches, data-parallel replicas) merge exactly. ``sig`` (over
``l2``) is scale-free and about N(0, 1) for unstructured data: a permuted layout moves it
by O(1), while an error in the data moves it by about the data's relative error (so
``compare`` holds it to an absolute tolerance of ``max(atol, rtol)``).

NaN and Inf are counted, never stripped silently or allowed to poison the moments.

Adding a statistic: a statistic computed from the existing raw fields is one more
:class:`Stat` in :data:`STATS` (nothing else changes: every backend emits raw rows and
finalizes through :func:`finalize`); one that needs a new raw field also needs that
field in every backend's reduction (``core/_fused_stats.c``, the XLA path
``adapters/jax/stats.py``, ``adapters/tf/stats.py``, ``adapters/torch/stats.py``) —
``tests/test_stats.py`` checks every backend against :func:`reference_raw_rows` field by
field, so a backend that lacks it fails loudly. Stores record their ``stat_names``;
readers look statistics up by name.

Only numpy is used here (no other traintape module).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Final

import numpy as np
from numpy.typing import NDArray

Array = NDArray[np.float64]


class Merge(StrEnum):
    """How a raw field of two disjoint parts combines."""

    ADD = "add"
    MIN = "min"
    MAX = "max"
    M2 = "m2"  # sum of squared deviations: Chan's parallel formula (needs nfinite, sum)
    EXP = "exp"  # the larger exponent; the other part's scaled fields are rescaled to it


@dataclass(frozen=True)
class RawField:
    """One column of a raw row."""

    name: str
    merge: Merge
    empty: float
    """Value for a tensor (or part) with no elements."""
    doc: str


RAW_FIELDS: Final[tuple[RawField, ...]] = (
    RawField("numel", Merge.ADD, 0.0, "number of elements"),
    RawField("nfinite", Merge.ADD, 0.0, "number of finite elements"),
    RawField("sum", Merge.ADD, 0.0, "sum of the finite elements"),
    RawField("m2", Merge.M2, 0.0, "sum of squared deviations of the finite elements from their mean"),
    RawField("min", Merge.MIN, np.inf, "minimum finite element (+inf if none)"),
    RawField("max", Merge.MAX, -np.inf, "maximum finite element (-inf if none)"),
    RawField("sumsq", Merge.ADD, 0.0, "sum of squares of the finite elements"),
    RawField("abs_sum", Merge.ADD, 0.0, "sum of |x| over the finite elements"),
    RawField("zeros", Merge.ADD, 0.0, "number of elements equal to zero"),
    RawField("nan", Merge.ADD, 0.0, "number of NaN elements"),
    RawField("exp", Merge.EXP, 0.0, "power-of-two exponent e of the scaled fields (see SCALED)"),
    RawField("sig", Merge.ADD, 0.0, "sum of s(c) x over the finite elements, c the canonical index (pattern_sign)"),
)  # fmt: skip
"""Raw-row layout shared by every backend (the C kernel's ``enum`` is checked against
these names when it is loaded)."""

RAW_NAMES: Final[tuple[str, ...]] = tuple(f.name for f in RAW_FIELDS)
N_RAW: Final[int] = len(RAW_FIELDS)
RAW_INDEX: Final[dict[str, int]] = {n: i for i, n in enumerate(RAW_NAMES)}
SCALED: Final[dict[str, int]] = {"sum": 1, "abs_sum": 1, "sig": 1, "m2": 2, "sumsq": 2}
"""Raw fields held in units of ``2**(p * exp)`` (field name → power ``p``).

A part whose largest finite ``|x|`` reaches :data:`SCALE_FROM` (float64 data), or whose
sums overflowed in a backend's float32 accumulators (beyond ~1e19), is reduced as
``x * 2**-e`` instead, ``e`` the exponent of its largest finite ``|x|`` (``frexp``), and
records ``exp = e``; otherwise ``exp = 0``. Below ``SCALE_FROM`` float64 sums of up to
2**63 elements cannot overflow, within a part or when parts are merged.
Scaling by a power of two is exact, so a scaled part finalizes to the same numbers
bit for bit (barring subnormals) — only the range changes: statistics are finite
whenever the statistic itself is representable. min and max are never scaled."""
SCALE_FROM: Final[float] = 2.0**480
"""Largest finite ``|x|`` from which a part is reduced scaled (see :data:`SCALED`)."""
COUNT_FIELDS: Final[tuple[str, ...]] = ("numel", "nfinite", "zeros", "nan")
"""Raw fields that are element counts (exact integers; device backends that carry raw
rows in float32 send these as int32 bit patterns)."""


class Raw:
    """Named read access to raw rows ``[..., N_RAW]``: ``Raw(rows).sum`` is a column."""

    __slots__ = ("rows",)

    def __init__(self, rows: Array) -> None:
        self.rows = rows

    def __getattr__(self, name: str) -> Array:
        try:
            return self.rows[..., RAW_INDEX[name]]
        except KeyError:
            raise AttributeError(f"no raw field {name!r}; raw fields: {RAW_NAMES}") from None


@dataclass(frozen=True)
class Stat:
    """One statistic of the stat vector: a formula over the raw fields."""

    name: str
    doc: str
    formula: Callable[[Raw], Array]
    when_empty: float | None
    """Value when the tensor has no finite element (None: the formula's value stands)."""


def _ratio(num: Array, den: Array) -> Array:
    """num / den for element counts ``den`` (>= 0), with 0 / 0 = 0 (never a warning)."""
    return num / np.maximum(den, 1.0)


def _unscale(v: Array, r: Raw) -> Array:
    """``v * 2**exp``: a value in the units of the first-power :data:`SCALED` fields
    back in the data's units (``ldexp``: exact, and inf only if the value overflows)."""
    return np.ldexp(v, r.exp.astype(np.int64))


STATS: Final[tuple[Stat, ...]] = (
    Stat("mean", "mean of the finite elements", lambda r: _unscale(_ratio(r.sum, r.nfinite), r), np.nan),
    Stat(
        "std",
        "population standard deviation of the finite elements",
        lambda r: _unscale(np.sqrt(_ratio(np.maximum(r.m2, 0.0), r.nfinite)), r),
        np.nan,
    ),
    Stat("min", "minimum finite element", lambda r: r.min, np.nan),
    Stat("max", "maximum finite element", lambda r: r.max, np.nan),
    Stat("l2", "sqrt(sum x^2) over the finite elements", lambda r: _unscale(np.sqrt(r.sumsq), r), 0.0),
    Stat(
        "abs_mean",
        "mean |x| over the finite elements",
        lambda r: _unscale(_ratio(r.abs_sum, r.nfinite), r),
        np.nan,
    ),
    Stat(
        "zero_frac",
        "count(x == 0) / numel over all elements (NaN if numel == 0)",
        lambda r: np.where(r.numel > 0, _ratio(r.zeros, r.numel), np.nan),
        None,
    ),
    Stat("nan_count", "number of NaN elements", lambda r: r.nan, None),
    Stat("inf_count", "number of +Inf or -Inf elements", lambda r: r.numel - r.nfinite - r.nan, None),
    Stat(
        "sig",
        "layout signature sum s(c) x / l2 over the finite elements (s: pattern_sign)",
        # sig and sqrt(sumsq) are both in units of 2**exp: the ratio needs no unscaling
        lambda r: r.sig / np.where(r.sumsq > 0, np.sqrt(np.maximum(r.sumsq, 0.0)), 1.0),
        np.nan,
    ),
)  # fmt: skip
"""The stat vector, in store order."""

STAT_NAMES: Final[tuple[str, ...]] = tuple(s.name for s in STATS)
N_STATS: Final[int] = len(STATS)
STAT_INDEX: Final[dict[str, int]] = {n: i for i, n in enumerate(STAT_NAMES)}


def stat_column(vectors: Array, name: str, stat_names: Sequence[str] = STAT_NAMES) -> Array:
    """Column ``name`` of stat vectors ``[..., len(stat_names)]`` (a store's own
    ``stat_names`` when it was written with another set). Raises KeyError naming it."""
    try:
        i = list(stat_names).index(name)
    except ValueError:
        raise KeyError(f"no statistic {name!r}; this data has {list(stat_names)}") from None
    return vectors[..., i]


LEGACY_STAT_NAMES: Final[tuple[tuple[str, ...], ...]] = (STAT_NAMES[:9],)
"""Stat vectors of older schema versions a store may still hold (before 1.4.0: no
``sig``). A store keeps the ``stat_names`` it was written with; readers look statistics
up by name, and a statistic a store lacks reads as not recorded."""


# ---------------------------------------------------------------------------- pattern
_M1, _M2 = 0x85EBCA6B, 0xC2B2AE35


def pattern_sign(c: Any) -> NDArray[np.float64]:
    """The ±1 pattern of the ``sig`` raw field at canonical flat indices ``c`` (integers,
    taken mod 2**32): ``h = c; h ^= h >> 16; h *= 0x85EBCA6B; h ^= h >> 13;
    h *= 0xC2B2AE35`` in uint32 arithmetic (murmur3's finalizer, less its last step),
    and ``s = -1`` where bit 31 of ``h`` is set, else ``+1``. Every backend computes this
    same hash (the C kernel flips the sign bit of ``x`` with bit 31 of ``h``)."""
    h = (np.asarray(c).astype(np.int64) & 0xFFFFFFFF).astype(np.uint32)
    h ^= h >> np.uint32(16)
    h *= np.uint32(_M1)
    h ^= h >> np.uint32(13)
    h *= np.uint32(_M2)
    return np.where(h >> np.uint32(31), -1.0, 1.0)


@dataclass(frozen=True)
class IndexMap:
    """Where the elements of an array held in a framework's layout sit in the canonical
    tensor: the element at multi-index ``(i_0, ..., i_{k-1})`` of the held array has
    canonical flat index ``offset + sum(i_a * strides[a])`` (mod 2**32). Build one with
    :func:`index_map`; ``None`` in its place means the identity (the held array *is*
    the canonical tensor, flattened row-major)."""

    strides: tuple[int, ...]
    offset: int = 0

    def indices(self, shape: Sequence[int]) -> NDArray[np.int64]:
        """Canonical flat indices (mod 2**32) of an array of ``shape`` held this way."""
        if len(shape) != len(self.strides):
            raise ValueError(
                f"index map of rank {len(self.strides)} for an array of shape {tuple(shape)}"
            )
        c = np.full(tuple(shape), self.offset % 2**32, dtype=np.int64)
        for a, (n, st) in enumerate(zip(shape, self.strides, strict=True)):
            ax = [1] * len(shape)
            ax[a] = n
            c = c + (np.arange(n, dtype=np.int64) * (st % 2**32)).reshape(ax)
        return c & 0xFFFFFFFF

    def collapsed(self, shape: Sequence[int]) -> tuple[list[int], list[int], int]:
        """``(dims, strides, offset)`` of the same map with unit axes dropped and axes
        that step contiguously in the canonical index merged (an identity map is one axis
        of stride 1), strides and offset mod 2**32: the kernels' form."""
        dims: list[int] = []
        strides: list[int] = []
        for n, st in zip(shape, self.strides, strict=True):
            if n == 1:
                continue
            st %= 2**32
            if dims and strides[-1] == (st * n) % 2**32:
                dims[-1] *= n
                strides[-1] = st
            else:
                dims.append(int(n))
                strides.append(st)
        if not dims:
            dims, strides = [1], [1]
        return dims, strides, self.offset % 2**32


def index_map(
    shape: Sequence[int | None],
    permutation: Sequence[int] | None = None,
    *,
    batch: bool = False,
    start: Sequence[int] | None = None,
) -> IndexMap | None:
    """The :class:`IndexMap` of an array held in source layout ``shape`` (the whole
    tensor's, before ``permutation``; canonical = source.transpose(permutation)).

    ``batch``: the canonical axis 0 is a free batch axis (activations): it gets stride 0,
    so the pattern runs over the per-example index. ``start``: the held array is the part
    of the source tensor starting at these source indices (a shard or row block; its own
    shape is whatever it holds). Returns None for the identity. Adapters ask again every
    step for the same tensors: the answers are memoised (an :class:`IndexMap` is frozen)."""
    return _index_map(
        tuple(None if s is None else int(s) for s in shape),
        None if permutation is None else tuple(int(p) for p in permutation),
        batch,
        None if start is None else tuple(int(s) for s in start),
    )


@functools.lru_cache(maxsize=4096)
def _index_map(
    shape: tuple[int | None, ...],
    permutation: tuple[int, ...] | None,
    batch: bool,
    start: tuple[int, ...] | None,
) -> IndexMap | None:
    rank = len(shape)
    perm = list(range(rank)) if permutation is None else list(permutation)
    cshape = [shape[p] for p in perm]
    cstrides = [0] * rank
    acc = 1
    for a in range(rank - 1, -1, -1):
        if batch and a == 0:
            break
        cstrides[a] = acc
        acc *= int(cshape[a] or 0)
    strides = [0] * rank
    for a, p in enumerate(perm):
        strides[p] = cstrides[a]
    offset = sum(int(s) * st for s, st in zip(start or [0] * rank, strides, strict=True))
    identity = perm == list(range(rank)) and not batch and offset == 0
    return None if identity else IndexMap(tuple(strides), offset)


def activation_map(shape: Sequence[int | None]) -> IndexMap | None:
    """:func:`index_map` of an activation held in the canonical layout: axis 0 is the
    free batch axis (stride 0); a scalar has none."""
    return index_map(shape, batch=True) if len(shape) else None


def sig_of(x: np.ndarray, imap: IndexMap | None = None) -> float:
    """The ``sig`` raw field of host array ``x`` held as ``imap`` says (reference)."""
    v = as_float(np.asarray(x)).astype(np.float64)
    c = (
        np.arange(v.size, dtype=np.int64).reshape(v.shape)
        if imap is None
        else imap.indices(v.shape)
    )
    fin = np.isfinite(v)
    return float(np.sum(np.where(fin, v, 0.0) * pattern_sign(c)))


# ---------------------------------------------------------------------------- algebra
def empty_raw(n: int) -> Array:
    """Raw rows ``[n, N_RAW]`` of ``n`` tensors with no elements."""
    return np.tile(np.array([f.empty for f in RAW_FIELDS], dtype=np.float64), (n, 1))


_EXP = RAW_INDEX["exp"]


def merge(a: Any, b: Any, xp: Any = np) -> Any:
    """Raw rows ``[..., N_RAW]`` of the union of two disjoint parts of the same tensors.

    Exact up to float64 rounding (Chan's formula for ``m2``); an empty part is neutral.
    ``xp`` is the array namespace of ``a`` and ``b``: numpy (default), ``torch`` (device
    merges of micro-batch rows) or ``jax.numpy`` — only ``+``, ``/``, ``*``, indexing and
    ``xp.minimum/maximum/where/stack`` are used, so one definition serves every backend.
    """
    if xp is np:
        a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    # the part with the smaller exponent is brought to the larger one (2.0 ** (d <= 0)
    # never overflows; it underflows only for a part negligible beside the other); a
    # part without finite elements has no say
    na, nb = a[..., RAW_INDEX["nfinite"]], b[..., RAW_INDEX["nfinite"]]
    ea, eb = a[..., _EXP], b[..., _EXP]
    e = xp.maximum(xp.where(na > 0, ea, eb), xp.where(nb > 0, eb, ea))
    a, b = rescale(a, e, xp), rescale(b, e, xp)
    sa, sb = a[..., RAW_INDEX["sum"]], b[..., RAW_INDEX["sum"]]
    cols = []
    for i, f in enumerate(RAW_FIELDS):
        ai, bi = a[..., i], b[..., i]
        if f.merge is Merge.EXP:
            cols.append(e)
        elif f.merge is Merge.ADD:
            cols.append(ai + bi)
        elif f.merge is Merge.MIN:
            cols.append(xp.minimum(ai, bi))
        elif f.merge is Merge.MAX:
            cols.append(xp.maximum(ai, bi))
        else:  # M2: the parts' m2 plus the spread of their means
            n = na + nb
            delta = sb / xp.where(nb > 0, nb, 1.0) - sa / xp.where(na > 0, na, 1.0)
            cross = delta * delta * (na * nb) / xp.where(n > 0, n, 1.0)
            cols.append(ai + bi + xp.where((na > 0) & (nb > 0), cross, 0.0))
    return xp.stack(cols, -1)


def rescale(raw: Any, exp: Any, xp: Any = np) -> Any:
    """Raw rows ``[..., N_RAW]`` with their :data:`SCALED` fields expressed in units of
    ``2**exp`` (``exp`` broadcast over the rows; exact for powers of two unless a value
    leaves the float range). ``xp``: the array namespace, as in :func:`merge`."""
    f = 2.0 ** (raw[..., _EXP] - exp)
    cols = []
    for i, field in enumerate(RAW_FIELDS):
        p = SCALED.get(field.name, 0)
        if field.name == "exp":
            cols.append(raw[..., i] * 0 + exp)
        else:
            cols.append(raw[..., i] if p == 0 else raw[..., i] * (f if p == 1 else f * f))
    return xp.stack(cols, -1)


def merge_all(parts: Array) -> Array:
    """Merge raw rows ``[k, ..., N_RAW]`` of ``k`` disjoint parts, in order (deterministic)."""
    parts = np.asarray(parts, dtype=np.float64)
    if parts.shape[0] == 0:
        return empty_raw(int(np.prod(parts.shape[1:-1], dtype=np.int64))).reshape(parts.shape[1:])
    out = parts[0]
    for p in parts[1:]:
        out = merge(out, p)
    return out


def finalize(raw: Array) -> Array:
    """Raw rows ``[..., N_RAW]`` → stat vectors ``[..., N_STATS]`` float64 (STAT_NAMES order)."""
    raw = np.asarray(raw, dtype=np.float64)
    if raw.shape[-1] != N_RAW:
        raise ValueError(f"raw rows have {raw.shape[-1]} fields, expected {N_RAW} ({RAW_NAMES})")
    r = Raw(raw)
    out = np.empty((*raw.shape[:-1], N_STATS), dtype=np.float64)
    for i, s in enumerate(STATS):  # formulas never divide by zero (see _ratio)
        out[..., i] = s.formula(r)
    none = r.nfinite == 0
    if none.any():
        out[none] = np.where(_EMPTY_MASK, _EMPTY_VALUES, out[none])
    return out


_EMPTY_MASK = np.array([s.when_empty is not None for s in STATS])
_EMPTY_VALUES = np.array([np.nan if s.when_empty is None else s.when_empty for s in STATS])


# ---------------------------------------------------------------------------- reference
_SMALL = 1 << 16  # arrays up to this size are reduced together (a handful of passes)


def as_float(a: np.ndarray) -> np.ndarray:
    """The values statistics are taken of: float32/float64 as they are; float16,
    bfloat16, integers and booleans promoted to float32 (the same in every backend)."""
    if a.dtype.kind == "f" and a.dtype.itemsize >= 4:
        return a
    if a.dtype.kind in "fiub" or a.dtype.name == "bfloat16":
        return a.astype(np.float32)
    raise TypeError(f"cannot take statistics of dtype {a.dtype.name}")


def reference_raw(x: np.ndarray, imap: IndexMap | None = None) -> Array:
    """Raw row ``[N_RAW]`` of one array (any shape), float64 accumulation, two-pass m2."""
    return reference_raw_rows([x], [imap])[0]


def _signs(a: np.ndarray, imap: IndexMap | None) -> NDArray[np.float64]:
    """The ``sig`` pattern of array ``a`` held as ``imap`` says, flattened row-major."""
    if imap is None:
        return pattern_sign(np.arange(np.size(a), dtype=np.int64))
    return pattern_sign(imap.indices(np.shape(a))).ravel()


def reference_raw_rows(
    arrays: Sequence[np.ndarray], maps: Sequence[IndexMap | None] | None = None
) -> Array:
    """Numpy reference: raw rows ``[len(arrays), N_RAW]`` float64 of host arrays.

    ``maps``: each array's :class:`IndexMap` (None, or a None entry: the identity).
    Arrays up to 64k elements are concatenated and reduced with ``ufunc.reduceat`` (a
    handful of passes whatever their number); larger ones one at a time. An array whose
    sums overflow float64 (``|x|`` beyond ~1e154) is reduced again scaled
    (:data:`SCALED`).
    """
    maps = [None] * len(arrays) if maps is None else list(maps)
    if len(maps) != len(arrays):
        raise ValueError(f"{len(maps)} index maps for {len(arrays)} arrays")
    out = empty_raw(len(arrays))
    small = [i for i, a in enumerate(arrays) if 0 < np.size(a) <= _SMALL]
    with np.errstate(over="ignore", invalid="ignore"):
        for i, a in enumerate(arrays):
            if np.size(a) > _SMALL:
                x = as_float(np.asarray(a))
                out[i] = _raw_rows_flat([x.ravel()], [_signs(x, maps[i])])[0]
            elif np.size(a) == 0:
                as_float(np.asarray(a))  # dtype check
        if small:
            xs = [as_float(np.asarray(arrays[i])) for i in small]
            out[small] = _raw_rows_flat(
                [x.ravel() for x in xs],
                [_signs(x, maps[i]) for x, i in zip(xs, small, strict=True)],
            )
        for j in np.flatnonzero(needs_scaling(out)):
            i = int(j)
            x = as_float(np.asarray(arrays[i]))
            sg = _signs(x, maps[i])
            x = x.ravel().astype(np.float64)
            big = max(abs(out[i, RAW_INDEX["min"]]), abs(out[i, RAW_INDEX["max"]]))
            e = int(np.frexp(big)[1])
            row = _raw_rows_flat([np.where(np.isfinite(x), np.ldexp(x, -e), x)], [sg])[0]
            for name in SCALED:
                out[i, RAW_INDEX[name]] = row[RAW_INDEX[name]]
            out[i, RAW_INDEX["exp"]] = e
    return out


def needs_scaling(raw: Array) -> NDArray[np.bool_]:
    """Rows ``[...]`` of unscaled raw rows to reduce again scaled (:data:`SCALED`): some
    finite element, and the largest finite ``|x|`` reaches :data:`SCALE_FROM` or a
    scaled field is not finite (the sums overflowed)."""
    r = Raw(np.asarray(raw))
    bad = np.maximum(np.abs(r.min), np.abs(r.max)) >= SCALE_FROM
    for name in SCALED:
        bad |= ~np.isfinite(getattr(r, name))
    return bad & (r.nfinite > 0)


def _raw_rows_flat(parts: list[np.ndarray], signs: list[np.ndarray]) -> Array:
    sizes = np.array([p.size for p in parts], dtype=np.int64)
    x = np.concatenate([p.astype(np.float64, copy=False) for p in parts])
    starts = np.concatenate(([0], np.cumsum(sizes)[:-1]))
    finite = np.isfinite(x)
    nfin = np.add.reduceat(finite, starts, dtype=np.float64)
    xz = np.where(finite, x, 0.0)
    s = np.add.reduceat(xz, starts)
    mean = _ratio(s, nfin)
    dev = np.where(finite, x - np.repeat(mean, sizes), 0.0)
    cols = {
        "numel": sizes.astype(np.float64),
        "nfinite": nfin,
        "sum": s,
        "m2": np.add.reduceat(dev * dev, starts),
        "min": np.minimum.reduceat(np.where(finite, x, np.inf), starts),
        "max": np.maximum.reduceat(np.where(finite, x, -np.inf), starts),
        "sumsq": np.add.reduceat(xz * xz, starts),
        "abs_sum": np.add.reduceat(np.abs(xz), starts),
        "zeros": np.add.reduceat(x == 0, starts, dtype=np.float64),
        "nan": np.add.reduceat(np.isnan(x), starts, dtype=np.float64),
        "exp": np.zeros(len(parts)),
        "sig": np.add.reduceat(xz * np.concatenate(signs), starts),
    }
    return np.stack([cols[n] for n in RAW_NAMES], axis=1)


def reference_stats(
    arrays: Sequence[np.ndarray], maps: Sequence[IndexMap | None] | None = None
) -> Array:
    """Stat vectors ``[len(arrays), N_STATS]`` of host arrays with the numpy reference."""
    return finalize(reference_raw_rows(arrays, maps))
