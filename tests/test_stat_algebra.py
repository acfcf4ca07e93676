"""The stat algebra (traintape.schema.stats) is the one definition every backend follows.

- every backend's raw rows equal the numpy reference, field by field (a backend that
  lacks a raw field fails here, naming it);
- ``merge`` of the raw rows of disjoint parts equals the raw row of the whole, in
  numpy, torch and jax.numpy;
- a statistic derived from the raw fields is added by editing that one module, and it
  flows from every adapter to the store and the reader.
"""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from traintape.schema.stats import (
    COUNT_FIELDS,
    RAW_INDEX,
    RAW_NAMES,
    STAT_NAMES,
    finalize,
    index_map,
    merge,
    merge_all,
    reference_raw_rows,
    reference_stats,
    rescale,
)

ROOT = Path(__file__).resolve().parents[1]


def _cases() -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    big = rng.normal(2.0, 3.0, size=(300, 257)).astype(np.float32)
    bad = rng.normal(size=70_000).astype(np.float32)
    bad[[3, 9]] = np.nan
    bad[[5]] = np.inf
    bad[[7, 8]] = 0.0
    return [
        rng.normal(size=(7, 5)).astype(np.float32),
        np.array([1.0, np.nan, 0.0, -np.inf, 3.0], np.float32),
        np.full(3, np.nan, np.float32),
        np.zeros(4, np.float32),
        big,
        bad,
        (1000 + 1e-3 * rng.normal(size=5000)).astype(np.float32),
    ]


def _check(got: np.ndarray, want: np.ndarray, backend: str, rtol: float) -> None:
    assert got.shape == want.shape, f"{backend}: shape {got.shape} != {want.shape}"
    # backends may hold sums scaled by another power of two (``exp``): same units first
    got = rescale(got, want[:, RAW_INDEX["exp"]])
    for name in RAW_NAMES:
        i = RAW_INDEX[name]
        g, w = got[:, i], want[:, i]
        if name in COUNT_FIELDS:
            np.testing.assert_array_equal(g, w, err_msg=f"{backend}: raw field {name}")
        elif name == "m2":  # float32 one-pass paths: relative to the spread actually present
            np.testing.assert_allclose(
                g, w, rtol=1e-3, atol=1e-3 * np.nanmax(np.abs(w)), err_msg=f"{backend}: m2"
            )
        else:
            scale = np.where(np.isfinite(w), np.abs(w), 0.0)
            np.testing.assert_allclose(
                g, w, rtol=rtol, atol=rtol * (1 + scale.max()), err_msg=f"{backend}: {name}"
            )


def test_host_kernel_raw_rows_equal_reference() -> None:
    from traintape.core.stats import raw_rows

    xs = _cases()
    _check(raw_rows(xs), reference_raw_rows(xs), "host kernel", 1e-6)


def test_jax_backends_raw_rows_equal_reference(monkeypatch) -> None:
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    from traintape.adapters.jax import ffi_kernel
    from traintape.adapters.jax.stats import decode_raw, raw_matrix

    xs = _cases()
    want = reference_raw_rows(xs)
    got = decode_raw(np.asarray(jax.jit(raw_matrix)([jnp.asarray(x) for x in xs])))
    _check(got, want, "jax xla", 1e-4)
    if ffi_kernel.available():
        rows = jax.jit(ffi_kernel.raw_rows)([jnp.asarray(x) for x in xs])
        _check(ffi_kernel.decode(np.asarray(rows)), want, "jax ffi kernel", 1e-6)


def test_torch_backends_raw_rows_equal_reference(monkeypatch) -> None:
    torch = pytest.importorskip("torch")
    from traintape.adapters.torch import stats as TS

    xs = _cases()
    want = reference_raw_rows(xs)
    _check(TS.raw_stats([torch.from_numpy(x) for x in xs]).numpy(), want, "torch cpu", 1e-6)
    monkeypatch.setattr(TS, "_fused_ok", lambda: False)  # the torch-ops path (CUDA's)
    _check(TS.raw_stats([torch.from_numpy(x) for x in xs]).numpy(), want, "torch ops", 2e-5)


def test_tf_backends_raw_rows_equal_reference() -> None:
    tf = pytest.importorskip("tensorflow")
    from traintape.adapters.tf.stats import host_raw_matrices, raw_matrix

    xs = _cases()
    want = reference_raw_rows(xs)
    _check(raw_matrix([tf.constant(x) for x in xs]).numpy(), want, "tf ops", 2e-5)
    _check(host_raw_matrices([[tf.constant(x) for x in xs]])[0], want, "tf host", 1e-6)


def _extreme_cases() -> dict[str, tuple[np.ndarray, int]]:
    """Data whose plain sums of squares overflow (float32 accumulators beyond ~1e19,
    float64 beyond ~1e154), with a power of two ``2**k`` that brings it to ~1."""
    rng = np.random.default_rng(3)
    f64 = rng.normal(size=3000) * 1e200
    f64[[5, 9]] = [np.nan, np.inf]
    return {
        "f32 1e22 small": (rng.normal(size=3000).astype(np.float32) * np.float32(1e22), 73),
        "f32 1e22 large": (rng.normal(size=100_000).astype(np.float32) * np.float32(1e22), 73),
        "f64 1e200 small": (f64, 664),
        "f64 1e200 large": (rng.normal(size=100_000) * 1e200, 664),
        "f64 1e300 one": (np.array([1e300, -3e299, 0.0]), 997),
    }


def _truth(x: np.ndarray, k: int) -> np.ndarray:
    """mean, std, l2, abs_mean of the finite elements, by numpy on ``x * 2**-k`` (no
    traintape code), scaled back."""
    xs = np.ldexp(x.astype(np.float64), -k)
    xs = xs[np.isfinite(xs)]
    return np.ldexp([xs.mean(), xs.std(), np.linalg.norm(xs), np.abs(xs).mean()], k)


def _backends_of(x: np.ndarray) -> dict[str, np.ndarray]:
    """Stat vectors of ``x`` from every backend that takes its dtype."""
    import jax
    import jax.numpy as jnp
    import tensorflow as tf
    import torch

    from traintape.adapters.jax import ffi_kernel
    from traintape.adapters.jax import stats as JS
    from traintape.adapters.tf import stats as TFS
    from traintape.adapters.torch import stats as TS
    from traintape.core.stats import stat_vectors

    out = {
        "reference": reference_stats([x])[0],
        "host kernel": stat_vectors([x])[0],
        "torch": TS.stat_vectors([torch.from_numpy(x)])[0],
        "tf ops": TFS.stat_matrix([tf.constant(x)])[0],
    }
    if x.dtype == np.float32:  # the XLA path reduces in float32
        out["jax xla"] = JS.stat_matrix([jnp.asarray(x)])[0]
    if ffi_kernel.available():
        jax.config.update("jax_enable_x64", True)  # float64 arrays stay float64
        try:
            rows = jax.jit(ffi_kernel.raw_rows)([jnp.asarray(x)])
            out["jax ffi kernel"] = finalize(ffi_kernel.decode(np.asarray(rows)))[0]
        finally:
            jax.config.update("jax_enable_x64", False)
    return out


def test_sums_beyond_the_float_range_are_scaled_not_overflowed(monkeypatch) -> None:
    """float32 gradients of ~1e22 (a run blowing up) and float64 data beyond ~1e154
    overflow plain sums of squares: every backend must still give finite, right std, l2
    and mean — not inf, and not the 0 that ``max(inf - inf, 0)`` makes of std."""
    for module in ("torch", "tensorflow", "jax"):
        pytest.importorskip(module)
    import torch

    from traintape.adapters.torch import stats as TS

    cols = [STAT_NAMES.index(n) for n in ("mean", "std", "l2", "abs_mean")]
    for case, (x, k) in _extreme_cases().items():
        want = _truth(x, k)
        got = _backends_of(x)
        monkeypatch.setattr(TS, "_fused_ok", lambda: False)  # the torch-ops path (CUDA's)
        got["torch ops"] = TS.stat_vectors([torch.from_numpy(x)])[0]
        monkeypatch.undo()
        for backend, v in got.items():
            # mean of zero-mean data: relative to the spread (float32 device sums)
            np.testing.assert_allclose(
                v[cols], want, rtol=5e-5, atol=5e-5 * want[1], err_msg=f"{case}: {backend}"
            )


def test_merge_brings_scaled_parts_to_one_exponent() -> None:
    """Parts reduced at different scales (one beyond SCALE_FROM, one not) merge to the
    whole's statistics, in either order."""
    rng = np.random.default_rng(4)
    small, big = rng.normal(size=500), rng.normal(size=700) * 1e160
    parts = reference_raw_rows([small, big])
    assert parts[0, RAW_INDEX["exp"]] == 0 and parts[1, RAW_INDEX["exp"]] > 0
    want = _truth(np.concatenate([small, big]), 532)
    cols = [STAT_NAMES.index(n) for n in ("mean", "std", "l2", "abs_mean")]
    for a, b in ((0, 1), (1, 0)):
        got = finalize(merge(parts[a], parts[b]))
        np.testing.assert_allclose(got[cols], want, rtol=1e-12)


@pytest.mark.parametrize("namespace", ["numpy", "torch", "jax"])
def test_merge_of_parts_equals_whole(namespace: str) -> None:
    rng = np.random.default_rng(1)
    whole = rng.normal(3.0, 2.0, size=10_001)
    whole[[10, 20]] = np.nan
    whole[30] = -np.inf
    whole[40:45] = 0.0
    cuts = [0, 1, 2, 500, 500, 7000, 10_001]  # includes an empty part
    # each part says where it sits in the whole (the sig field's canonical index)
    parts = reference_raw_rows(
        [whole[a:b] for a, b in itertools.pairwise(cuts)],
        [index_map(whole.shape, start=(a,)) for a, _ in itertools.pairwise(cuts)],
    )
    want = reference_raw_rows([whole])[0]
    if namespace == "numpy":
        got = merge_all(parts[:, None, :])[0]
    elif namespace == "torch":
        torch = pytest.importorskip("torch")
        t = torch.from_numpy(parts)
        acc = t[0]
        for p in t[1:]:
            acc = merge(acc, p, torch)
        got = acc.numpy()
    else:
        pytest.importorskip("jax")
        import jax.numpy as jnp
        from jax import config

        config.update("jax_enable_x64", True)
        try:
            acc = jnp.asarray(parts[0])
            for p in parts[1:]:
                acc = merge(acc, jnp.asarray(p), jnp)
            got = np.asarray(acc)
        finally:
            config.update("jax_enable_x64", False)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-9)
    np.testing.assert_allclose(finalize(got), reference_stats([whole])[0], rtol=1e-12)


def test_a_derived_statistic_is_added_by_editing_one_module(tmp_path: Path) -> None:
    """Copy the package, add ``rms`` to STATS in schema/stats.py only, and record with the
    plain Recorder, the JAX adapter and the torch adapter: the store and the reader carry
    the new statistic with the right values."""
    pytest.importorskip("jax")
    pytest.importorskip("torch")
    pkg = tmp_path / "src" / "traintape"
    shutil.copytree(ROOT / "traintape", pkg, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    stats_py = pkg / "schema" / "stats.py"
    src = stats_py.read_text()
    anchor = ')  # fmt: skip\n"""The stat vector, in store order."""'
    assert src.count(anchor) == 1
    src = src.replace(
        anchor,
        '    Stat("rms", "root mean square", lambda r: np.sqrt(_ratio(r.sumsq, r.nfinite)), np.nan),\n'
        + anchor,
    )
    stats_py.write_text(src)
    script = textwrap.dedent(
        """
        import json, sys
        # the copy, not the editable install of the checkout
        sys.meta_path[:] = [f for f in sys.meta_path
                            if not type(f).__module__.startswith("__editable__")]
        sys.path.insert(0, sys.argv[3])
        import numpy as np
        import jax, jax.numpy as jnp, torch
        import traintape, traintape.jax as tj, traintape.torch as tt
        assert traintape.__file__.startswith(sys.argv[1]), traintape.__file__
        assert traintape.STAT_NAMES[-1] == "rms"
        out = {}
        x = np.arange(1, 7, dtype=np.float32).reshape(2, 3)
        with traintape.Recorder(sys.argv[2] + "/plain") as rec:
            rec.record(0, "param", {"w": x})
        run = traintape.open_run(sys.argv[2] + "/plain")
        out["plain"] = [float(run.stats("param")["rms"][0]), float(np.sqrt((x**2).mean()))]
        rec = traintape.Recorder(sys.argv[2] + "/jax")
        vg = tj.value_and_grad(lambda p: jnp.sum(p["w"] ** 2), recorder=rec)
        _, g = jax.jit(vg)({"w": jnp.asarray(x)})
        rec.close()
        df = traintape.open_run(sys.argv[2] + "/jax").stats("grad")
        out["jax"] = [float(df["rms"][0]), float(np.sqrt((np.asarray(g["w"]) ** 2).mean()))]
        m = torch.nn.Linear(3, 2)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        with traintape.Recorder(sys.argv[2] + "/torch") as rec, tt.watch(m, rec, optimizer=opt):
            m(torch.ones(4, 3)).sum().backward()
            g = m.weight.grad.clone()
            opt.step()
        df = traintape.open_run(sys.argv[2] + "/torch").stats("grad")
        got = float(df[df.tensor == "kernel"]["rms"].iloc[0])
        out["torch"] = [got, float(g.pow(2).mean().sqrt())]
        print(json.dumps(out))
        """
    )
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "src")}
    res = subprocess.run(
        [sys.executable, "-c", script, str(pkg), str(tmp_path / "runs"), str(tmp_path / "src")],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    import json

    out = json.loads(res.stdout.strip().splitlines()[-1])
    for backend, (got, want) in out.items():
        assert got == pytest.approx(want, rel=1e-5), backend
