"""The host kernel's sign cache (``_fused_stats.c``): the ``sig`` pattern's signs are a
pure function of the canonical index, cached as bits per process. Cached or hashed, every
raw row is the same bit for bit."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from traintape.core import native
from traintape.core.stats import raw_rows
from traintape.schema.stats import RAW_INDEX, IndexMap, index_map, reference_raw_rows

pytestmark = pytest.mark.skipif(not native.fused_available(), reason="no C compiler for the kernel")

BLOCK = 32768  # must match _fused_stats.c
HERE = Path(__file__).resolve().parent
SIG = RAW_INDEX["sig"]


def cases() -> tuple[list[np.ndarray], list[IndexMap | None]]:
    """Buffers and index maps that take every path: the identity table (aligned or not,
    crossing its end), index map entries (transposed layouts, short rows), per-block
    hashing (wrapping mod 2**32), non-finite values and scaled blocks."""
    rng = np.random.default_rng(5)
    xs: list[np.ndarray] = []
    ms: list[IndexMap | None] = []
    for dt in (np.float32, np.float64):
        for shape in [(3 * BLOCK + 11,), (301, 407), (1000, 65), (64, 2049), (5, 3, 7, 97)]:
            x = rng.standard_normal(shape).astype(dt)
            flat = x.reshape(-1)
            flat[rng.integers(0, x.size, 3)] = np.nan
            flat[rng.integers(0, x.size, 2)] = -np.inf
            flat[rng.integers(0, x.size, 4)] = -0.0
            nd = len(shape)
            row_major = tuple(int(s) for s in np.cumprod((1, *shape[:0:-1]))[::-1])
            maps: list[IndexMap | None] = [
                None,
                index_map(shape, tuple(rng.permutation(nd))),
                index_map(shape, tuple(range(nd))[::-1]),
                IndexMap(row_major, 64 * 1000),  # a shard's offset, aligned
                IndexMap(row_major, 12345),  # not aligned
                IndexMap(row_major, 2**28 - 5000),  # crosses the identity table's end
                IndexMap(row_major, 2**32 - 777),  # wraps mod 2**32
            ]
            if nd >= 2:
                maps.append(index_map(shape, batch=True))
            for m in maps:
                xs.append(x)
                ms.append(m)
    big = rng.standard_normal(BLOCK + 100) * 1e300  # scaled blocks
    xs.append(big)
    ms.append(index_map((BLOCK + 100,)))
    xs.append(big.reshape(-1, 4))
    ms.append(index_map(big.reshape(-1, 4).shape, (1, 0)))
    return xs, ms


def _rows_in_subprocess(env: dict[str, str], nthreads: int, out: Path) -> tuple[np.ndarray, int]:
    """``raw_rows`` of :func:`cases` in a fresh process with ``env``; and the bytes its
    sign cache then holds."""
    code = (
        "import sys, numpy as np\n"
        f"sys.path.insert(0, {str(HERE)!r})\n"
        "from test_fused_sig_cache import cases\n"
        "from traintape.core import native\n"
        "from traintape.core.stats import raw_rows\n"
        "xs, ms = cases()\n"
        f"rows = raw_rows(xs, {nthreads}, ms)\n"
        "assert native.fused_available()\n"
        "print(native.sig_cache_bytes())\n"
        "np.save(sys.argv[1], rows)\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code, str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **env},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return np.load(out), int(r.stdout.split()[-1])


@pytest.mark.parametrize("nthreads", [1, 2])
def test_cached_and_hashed_signs_give_the_same_rows_bit_for_bit(nthreads: int, tmp_path) -> None:
    xs, ms = cases()
    cached = raw_rows(xs, nthreads, ms)
    again = raw_rows(xs, nthreads, ms)  # now every sign comes from the cache
    hashed, nbytes = _rows_in_subprocess(
        {"TRAINTAPE_SIG_CACHE_MIB": "0"}, nthreads, tmp_path / "rows.npy"
    )
    assert nbytes == 0  # every sign was hashed
    assert np.array_equal(cached.view(np.int64), again.view(np.int64))
    assert np.array_equal(cached.view(np.int64), hashed.view(np.int64))
    want = reference_raw_rows(xs, ms)
    sig, ref, l1 = (cached[:, SIG], want[:, SIG], want[:, RAW_INDEX["abs_sum"]])
    np.testing.assert_array_equal(cached[:, RAW_INDEX["exp"]], want[:, RAW_INDEX["exp"]])
    assert np.all(np.abs(sig - ref) <= 1e-5 * l1), np.abs(sig - ref) / l1


def test_cache_limit_and_size() -> None:
    before = native.sig_cache_bytes()
    x = np.random.default_rng(0).standard_normal((700, 300)).astype(np.float32)
    m = index_map(x.shape, (1, 0), start=(0, 0))
    m = IndexMap(m.strides, 4242) if m is not None else None  # a layout no other test uses
    raw_rows([x], 1, [m])
    assert native.sig_cache_bytes() > before  # its signs are cached now
    old = native.sig_cache_limit(0)
    try:
        assert native.sig_cache_limit() == 0
        full = native.sig_cache_bytes()
        y = np.random.default_rng(1).standard_normal((300, 701))
        m2 = IndexMap((1, 300), 99)
        got = raw_rows([y], 2, [m2])
        assert native.sig_cache_bytes() == full  # nothing cached beyond the limit
        np.testing.assert_allclose(got[0, SIG], reference_raw_rows([y], [m2])[0, SIG], rtol=1e-9)
    finally:
        assert native.sig_cache_limit(old) == 0
    assert native.sig_cache_limit() == old
