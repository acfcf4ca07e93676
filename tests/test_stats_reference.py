"""Every stats backend against an independent float64 numpy reference (issue 29).

The reference (:func:`reference_vector`) is written here from the stat definitions in
``traintape/schema/stats.py``'s docstring and goes through no traintape code: float64
numpy over the tensor's own values, and the ``sig`` pattern spelled again in plain
integers. Each backend is called on its own path, never routed to the host C kernel:

- ``numpy``: :func:`traintape.schema.stats.reference_raw_rows` (the host backend where the
  C kernel did not build, and the fallback for arrays it cannot take);
- ``host-c``: :func:`traintape.core.stats.raw_rows` (the fused C kernel);
- ``jax-ffi``: the same kernel as an XLA custom call, inside ``jax.jit``;
- ``xla``: :func:`traintape.adapters.jax.stats.stat_matrix` (XLA reductions);
- ``torch-ops``: :func:`traintape.adapters.torch.stats.raw_stats` with the host kernel
  switched off (the path CUDA uses: segment reductions for small tensors, foreach norms
  and per-tensor reductions for large ones);
- ``tf-ops``: :func:`traintape.adapters.tf.stats.raw_matrix` (the TF op graph).

Tolerances are per tensor and per statistic, relative to that tensor's own scale
(:func:`check`): counts and ``zero_frac`` exact, ``min``/``max`` exact, moments within
``rtol`` of the tensor's scale (``abs_mean`` for the mean, its RMS for ``std``, ``l2``,
``abs_mean``), ``sig`` within ``rtol * sum|x| / l2`` — so a wrong number in a tensor of
three elements fails as surely as one in a tensor of a million.

Merges: raw rows of three disjoint parts of one tensor, each part holding NaN, Inf and
zeros, merged with :func:`traintape.schema.stats.merge` (``xp=torch`` for torch), must
give the reference of the whole tensor (counts added, not maxed).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from traintape.schema.stats import STAT_NAMES, finalize, merge

# ---------------------------------------------------------------------------- reference
_M = np.uint64(0xFFFFFFFF)


def _signs(n: int) -> np.ndarray:
    """The sig pattern of flat indices 0..n-1: murmur3's finalizer less its last step,
    bit 31 set -> -1 (uint64 arithmetic masked to 32 bits: an independent spelling)."""
    h = np.arange(n, dtype=np.uint64) & _M
    h ^= h >> np.uint64(16)
    h = (h * np.uint64(0x85EBCA6B)) & _M
    h ^= h >> np.uint64(13)
    h = (h * np.uint64(0xC2B2AE35)) & _M
    return np.where(h >> np.uint64(31), -1.0, 1.0)


def reference_vector(x: np.ndarray) -> dict[str, float]:
    """The stat vector of ``x`` by the definitions, float64 numpy."""
    v = np.asarray(x).astype(np.float64).ravel()
    fin = np.isfinite(v)
    f = v[fin]
    out = {
        "zero_frac": float(np.mean(v == 0)) if v.size else np.nan,
        "nan_count": float(np.isnan(v).sum()),
        "inf_count": float(np.isinf(v).sum()),
        "l2": float(np.sqrt(np.sum(f * f))),
    }
    if f.size:
        mean = float(np.mean(f))
        s = _signs(v.size)
        out.update(
            mean=mean,
            std=float(np.sqrt(np.mean((f - mean) ** 2))),
            min=float(f.min()),
            max=float(f.max()),
            abs_mean=float(np.mean(np.abs(f))),
            sig=float(np.sum(np.where(fin, v, 0.0) * s) / out["l2"]) if out["l2"] > 0 else 0.0,
        )
    else:
        out.update(mean=np.nan, std=np.nan, min=np.nan, max=np.nan, abs_mean=np.nan, sig=np.nan)
    return out


def check(got: np.ndarray, x: np.ndarray, rtol: float, label: str) -> None:
    """``got`` (a stat vector in STAT_NAMES order) against the reference of ``x``, with
    tolerances scaled to this tensor alone."""
    want = reference_vector(x)
    v = np.asarray(x).astype(np.float64).ravel()
    f = v[np.isfinite(v)]
    abs_mean = float(np.mean(np.abs(f))) if f.size else 0.0
    rms = float(np.sqrt(np.mean(f * f))) if f.size else 0.0
    l2 = want["l2"]
    scale = {
        "mean": abs_mean,
        "std": rms,
        "l2": l2,
        "abs_mean": abs_mean,
        "sig": float(np.sum(np.abs(f))) / l2 if l2 > 0 else 0.0,
    }
    bad = []
    for i, name in enumerate(STAT_NAMES):
        g, w = float(got[i]), want[name]
        if np.isnan(w) or np.isnan(g):
            ok = np.isnan(w) and np.isnan(g)
        elif name in scale:
            ok = abs(g - w) <= rtol * scale[name] + 1e-300
        else:  # counts, zero_frac, min, max: exact
            ok = g == w
        if not ok:
            bad.append(f"{name}: got {g!r}, want {w!r}")
    assert not bad, f"{label} (shape {np.shape(x)}, {np.asarray(x).dtype}): " + "; ".join(bad)


# ------------------------------------------------------------------------------- cases
def _cases() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(29)

    def normal(*shape: int, dtype=np.float32, loc: float = 0.0) -> np.ndarray:
        return (loc + rng.normal(size=shape)).astype(dtype)

    big_zeros = normal(70_001)
    big_zeros[rng.choice(big_zeros.size, 7_000, replace=False)] = 0.0
    big_bad = normal(300, 300)
    big_bad[rng.choice(300, 20), rng.choice(300, 20)] = 0.0
    big_bad[5, 7], big_bad[100, 3], big_bad[299, 299] = np.nan, np.inf, -np.inf
    mixed = np.array([1.0, -4.0, 0.0, 2.5, -0.5], np.float32)
    return {
        "scalar": np.float32(-2.5).reshape(()),
        "one": np.array([3.0], np.float32),
        "three_mixed_signs": np.array([-1.0, 2.0, -3.5], np.float32),
        "five_with_zero": mixed,
        "small_nan_inf_zero": np.array([1.0, np.nan, 0.0, np.inf, -2.0, 0.0, -np.inf], np.float32),
        "all_nan": np.full(4, np.nan, np.float32),
        "zeros": np.zeros((3, 3), np.float32),
        "empty": np.zeros((0, 3), np.float32),
        "17": normal(17),
        "1000_offset": normal(1000, loc=3.0),
        "5000": normal(50, 100),
        "5000_nan": np.where(np.arange(5000).reshape(50, 100) % 777 == 5, np.nan, normal(50, 100)),
        "large_zeros": big_zeros,
        "large_nan_inf_zeros": big_bad,
        "float64": normal(40, dtype=np.float64),
        "float64_large": normal(70_000, dtype=np.float64),
        "float16": normal(20, dtype=np.float16),
        "int32": rng.integers(-5, 6, size=33).astype(np.int32),
    }


CASES = _cases()
NAMES = list(CASES)


def _ids(names: list[str]) -> list[np.ndarray]:
    return [CASES[n] for n in names]


# ---------------------------------------------------------------------------- backends
def _host_c() -> Callable[[list[np.ndarray]], np.ndarray]:
    from traintape.core import native
    from traintape.core.stats import raw_rows

    if not native.fused_available():
        pytest.skip("the host C kernel did not build")
    return raw_rows


def _numpy() -> Callable[[list[np.ndarray]], np.ndarray]:
    from traintape.schema.stats import reference_raw_rows

    return reference_raw_rows


def _jax_ffi() -> Callable[[list[np.ndarray]], np.ndarray]:
    pytest.importorskip("jax")
    import jax
    import jax.numpy as jnp

    from traintape.adapters.jax import ffi_kernel

    if not ffi_kernel.available():
        pytest.skip("the JAX FFI kernel is unavailable (no compiler / FFI header)")

    def raw(arrays):
        rows = jax.jit(ffi_kernel.raw_rows)([jnp.asarray(a) for a in arrays])
        return ffi_kernel.decode(np.asarray(rows))

    return raw


def _xla() -> Callable[[list[np.ndarray]], np.ndarray]:
    pytest.importorskip("jax")
    import jax.numpy as jnp

    from traintape.adapters.jax.stats import _jit_raw_matrix, decode_raw

    def raw(arrays):
        return decode_raw(np.asarray(_jit_raw_matrix([jnp.asarray(a) for a in arrays], None)))

    return raw


def _torch_ops(monkeypatch) -> Callable[[list[np.ndarray]], np.ndarray]:
    torch = pytest.importorskip("torch")
    from traintape.adapters.torch import stats as ts_

    monkeypatch.setattr(ts_, "_fused_ok", lambda: False)  # the path CUDA takes

    def raw(arrays):
        return ts_.raw_stats([torch.from_numpy(np.ascontiguousarray(a)) for a in arrays]).numpy()

    return raw


def _tf_ops() -> Callable[[list[np.ndarray]], np.ndarray]:
    tf = pytest.importorskip("tensorflow")
    from traintape.adapters.tf import stats as tfs

    def raw(arrays):
        return tfs.raw_matrix([tf.constant(a) for a in arrays]).numpy()

    return raw


BACKENDS = ["numpy", "host-c", "jax-ffi", "xla", "torch-ops", "tf-ops"]
# float32 accumulation (device paths, the C kernel's float32 lanes): ~1e-6 relative
RTOL = {
    "numpy": 1e-10,
    "host-c": 2e-6,
    "jax-ffi": 2e-6,
    "xla": 1e-5,
    "torch-ops": 1e-5,
    "tf-ops": 1e-5,
}


@pytest.fixture
def backend(request, monkeypatch):
    name = request.param
    make = {
        "numpy": _numpy,
        "host-c": _host_c,
        "jax-ffi": _jax_ffi,
        "xla": _xla,
        "torch-ops": lambda: _torch_ops(monkeypatch),
        "tf-ops": _tf_ops,
    }[name]
    return name, make()


def _seen(name: str, a: np.ndarray) -> np.ndarray:
    """The values backend ``name`` is handed (JAX without x64 holds float64 as float32)."""
    if name in ("jax-ffi", "xla") and a.dtype == np.float64:
        import jax

        if not jax.config.jax_enable_x64:
            return a.astype(np.float32)
    return a


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
def test_backend_matches_float64_reference_per_tensor(backend):
    name, raw = backend
    arrays = [_seen(name, a) for a in CASES.values()]
    got = finalize(np.asarray(raw(arrays), dtype=np.float64))
    assert got.shape == (len(arrays), len(STAT_NAMES))
    for case, a, g in zip(NAMES, arrays, got, strict=True):
        f64 = a.dtype == np.float64 and name in ("numpy", "host-c", "torch-ops")
        rtol = 1e-12 if f64 else RTOL[name]
        check(g, a, rtol, f"{name} {case}")


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
def test_backend_one_tensor_at_a_time(backend):
    """Each tensor alone (no batch-mates to share a fast or masked path with)."""
    name, raw = backend
    for case in ("three_mixed_signs", "five_with_zero", "large_zeros", "17"):
        a = _seen(name, CASES[case])
        check(finalize(np.asarray(raw([a]), dtype=np.float64))[0], a, RTOL[name], f"{name} {case}")


def _parts(x: np.ndarray, k: int = 3) -> list[np.ndarray]:
    return np.array_split(x.ravel(), k)


def _spread(n: int, seed: int) -> np.ndarray:
    """A tensor whose every third holds NaNs, Infs and zeros."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=n).astype(np.float32)
    third = n // 3
    for p in range(3):
        lo = p * third
        x[lo + 1 : lo + 1 + (p + 1)] = np.nan
        x[lo + 5] = np.inf if p % 2 else -np.inf
        x[lo + 7 : lo + 7 + (p + 2)] = 0.0
    return x


@pytest.mark.parametrize("n", [30, 300_000], ids=["small", "large"])
@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
def test_merged_parts_count_every_parts_nans_infs_zeros(backend, n):
    """Raw rows of three parts, each with NaN, Inf and zeros of its own, merge to the
    whole tensor's statistics (NaN/zero counts add across parts)."""
    name, raw = backend
    x = _spread(n, seed=n)
    parts = _parts(x)
    rows = np.asarray(raw(parts), dtype=np.float64)
    if name == "torch-ops":  # device merges use the same algebra with xp=torch
        import torch

        t = torch.from_numpy(rows)
        m = merge(merge(t[0], t[1], xp=torch), t[2], xp=torch).numpy()
    else:
        m = merge(merge(rows[0], rows[1]), rows[2])
    got = finalize(m)
    # the sig pattern of a part restarts at 0: compare sig against the parts' own sums
    want = reference_vector(x)
    assert got[STAT_NAMES.index("nan_count")] == want["nan_count"] == 6
    assert got[STAT_NAMES.index("inf_count")] == want["inf_count"] == 3
    assert got[STAT_NAMES.index("zero_frac")] == want["zero_frac"]
    for s in ("mean", "std", "min", "max", "l2", "abs_mean"):
        w = want[s]
        assert abs(got[STAT_NAMES.index(s)] - w) <= RTOL[name] * max(abs(w), want["abs_mean"]), s
