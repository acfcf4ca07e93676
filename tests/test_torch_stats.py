"""On-device torch stat vectors against the numpy reference."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from traintape.adapters.torch import stats as S  # noqa: E402
from traintape.core.stats import stat_vectors as reference  # noqa: E402
from traintape.schema.stats import finalize, index_map, merge  # noqa: E402

torch.set_num_threads(1)


def tensors():
    g = torch.Generator().manual_seed(0)
    big = torch.randn(S.SMALL + 5, generator=g) * 3 + 1  # large path
    big_bad = torch.randn(S.SMALL + 7, generator=g)
    big_bad[3], big_bad[7], big_bad[9] = float("nan"), float("inf"), 0.0
    small_bad = torch.randn(10, generator=g)
    small_bad[1], small_bad[2] = float("nan"), -float("inf")
    near_const = 1 + 1e-3 * torch.randn(16, generator=g)  # std << mean
    return [
        torch.randn(300, 400, generator=g),
        torch.randn(17, generator=g) + 5,
        torch.zeros(5),
        big,
        near_const,
        torch.empty(0),
        big_bad,
        small_bad,
        torch.full((3,), float("nan")),
        torch.randn(4, 5, generator=g).half(),
        torch.randn(6, generator=g).bfloat16(),
    ]


def test_stat_vectors_match_numpy_reference():
    ts = tensors()
    got = S.stat_vectors(ts)
    want = reference([t.float().numpy() for t in ts])
    assert got.shape == want.shape
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-7)
    assert got[6, 7] == 1 and got[6, 8] == 1  # NaN and Inf counted in the large tensor


def test_none_is_an_all_zero_tensor():
    got = S.stat_vectors([None])
    np.testing.assert_array_equal(got[0], reference([np.zeros(3, np.float32)])[0])


@pytest.mark.parametrize("size", [7, S.SMALL + 3])
def test_merge_equals_stats_of_concatenation(size):
    g = torch.Generator().manual_seed(1)
    a = torch.randn(size, generator=g) + 2
    b = torch.randn(size // 2 + 1, generator=g) * 5
    b[0] = float("nan")
    c = torch.full((4,), float("inf"))
    n = len(a) + len(b) + len(c)  # each part at its offset in the whole (sig)
    ra, rb, rc = (
        S.raw_stats([v], [index_map((n,), start=(k,))])
        for v, k in ((a, 0), (b, len(a)), (c, len(a) + len(b)))
    )
    merged = merge(merge(ra, rb, torch), rc, torch)
    got = finalize(merged.numpy())[0]
    want = reference([torch.cat([a, b, c]).numpy()])[0]
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-7)
