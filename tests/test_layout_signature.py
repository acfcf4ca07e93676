"""The layout signature ``sig`` (traintape.schema.stats): a statistic that sees where
each value sits in the canonical tensor.

- its pattern is one fixed hash of the canonical flat index, the same in every backend;
- every backend (numpy reference, C kernel, JAX XLA and FFI paths, torch, TF) gives the
  reference's value for tensors held in their framework's layout (a torch ``Linear``
  weight (out, in) with its index map equals the canonical (in, out) kernel; the
  transposed square kernel does not);
- parts (row-block shards, micro-batches of an activation) merge to the whole exactly;
- adapters hand the right maps: torch ``watch`` of a ``Linear`` records the sig of the
  canonical kernel (what the plain Recorder and the JAX adapter record for it).
"""

from __future__ import annotations

import numpy as np
import pytest
from test_stats import _sign  # the independent plain-Python spelling of the hash

import traintape as tt
from traintape.schema.stats import (
    STAT_INDEX,
    finalize,
    index_map,
    merge,
    pattern_sign,
    reference_raw_rows,
    reference_stats,
)

SIG = STAT_INDEX["sig"]


def test_pattern_is_the_documented_hash_of_the_index_mod_2_32() -> None:
    cs = [0, 1, 2, 3, 1023, 1024, 65535, 65536, 2**31 - 1, 2**31, 2**32 - 1, 12_345_678]
    assert pattern_sign(np.array(cs)).tolist() == [_sign(c) for c in cs]
    assert pattern_sign(np.array([2**32 + 5])).tolist() == [_sign(5)]  # mod 2**32
    s = pattern_sign(np.arange(1 << 20))
    assert abs(s.mean()) < 0.01  # balanced


@pytest.mark.parametrize("n", [3, 8, 16, 64, 128, 100, 1024])
def test_a_transposed_square_tensor_changes_sig(n: int) -> None:
    """Every other statistic is the same for W and W.T; sig tells them apart (for
    power-of-two sizes too: the pattern is no function of bit counts). Swapping the
    elements at canonical indices c and c' moves the signed sum by
    (s(c) - s(c')) (x_c - x_c'): a pair with equal signs is invisible, so a 2x2 (one
    pair) is caught only half the time; with many pairs a miss is vanishingly rare."""
    w = np.random.default_rng(n).normal(size=(n, n))
    a, b = reference_stats([w, w.T])
    others = [i for i in range(len(a)) if i != SIG]
    np.testing.assert_allclose(a[others], b[others], rtol=1e-12)
    assert abs(a[SIG] - b[SIG]) > 1e-3


def test_swapped_blocks_change_sig() -> None:
    """Swapped attention heads (column blocks of a q kernel) or LSTM gates (blocks of
    the gate axis) keep every permutation-invariant statistic; sig moves."""
    rng = np.random.default_rng(0)
    q = rng.normal(size=(32, 4 * 8))  # (embed, heads * head_dim)
    heads = q.reshape(32, 4, 8)[:, [1, 0, 2, 3]].reshape(32, 32)
    gates = rng.normal(size=(16, 4 * 16))  # (in, 4 * hidden), i f g o
    swapped = gates.reshape(16, 4, 16)[:, [0, 2, 1, 3]].reshape(16, 64)
    got = reference_stats([q, heads, gates, swapped])[:, SIG]
    assert abs(got[0] - got[1]) > 1e-3 and abs(got[2] - got[3]) > 1e-3


def _layout_cases() -> list[tuple[np.ndarray, object, np.ndarray | None, object]]:
    """(array held in a framework's layout, its index map, the canonical tensor, the
    canonical tensor's own map): the last two None for a shard (checked by merging)."""
    rng = np.random.default_rng(7)
    lin = rng.normal(size=(300, 257)).astype(np.float32)  # torch Linear (out, in)
    sq = rng.normal(size=(64, 64)).astype(np.float32)  # square (out, in)
    conv = rng.normal(size=(8, 3, 5, 5)).astype(np.float32)  # torch conv (O, I, kh, kw)
    act = rng.normal(size=(6, 4, 3, 5)).astype(np.float32)  # NCHW activation
    big = rng.normal(size=(3, 40_000)).astype(np.float32)  # several kernel blocks
    bad = rng.normal(size=(70, 1000)).astype(np.float32)
    bad[3, 5], bad[10, 7] = np.nan, np.inf
    huge = rng.normal(size=(20, 30)) * 1e200  # float64, sums scaled
    nhwc = act.transpose(0, 2, 3, 1)
    return [
        (lin, index_map(lin.shape, (1, 0)), lin.T, None),
        (sq, index_map(sq.shape, (1, 0)), sq.T, None),
        (conv, index_map(conv.shape, (2, 3, 1, 0)), conv.transpose(2, 3, 1, 0), None),
        (
            act,
            index_map(act.shape, (0, 2, 3, 1), batch=True),
            nhwc,
            index_map(nhwc.shape, batch=True),
        ),
        (big, index_map(big.shape, (1, 0)), big.T, None),
        (bad, index_map(bad.shape, (1, 0)), bad.T, None),
        (huge, index_map(huge.shape, (1, 0)), huge.T, None),
        (lin[100:200], index_map(lin.shape, (1, 0), start=(100, 0)), None, None),  # a shard
        (sq, None, sq, None),  # the square kernel taken as canonical: another tensor
    ]


def _sig_of_rows(raw: np.ndarray) -> np.ndarray:
    return finalize(np.asarray(raw, dtype=np.float64))[:, SIG]


def test_reference_on_held_layouts_equals_canonical() -> None:
    cases = _layout_cases()
    got = _sig_of_rows(reference_raw_rows([x for x, m, _, _ in cases], [m for _, m, _, _ in cases]))
    for i, (_, _, canon, cmap) in enumerate(cases):
        if canon is not None:
            want = reference_stats([np.ascontiguousarray(canon)], [cmap])[0, SIG]
            assert got[i] == pytest.approx(want, rel=1e-9, abs=1e-12), i
    # the square kernel held transposed, read without its map, is another tensor
    assert abs(got[1] - got[8]) > 1e-3


def _check(got_raw: np.ndarray, backend: str, rtol: float = 1e-5) -> None:
    cases = _layout_cases()
    want = reference_raw_rows([x for x, *_ in cases], [m for _, m, *_ in cases])
    np.testing.assert_allclose(
        _sig_of_rows(got_raw), _sig_of_rows(want), rtol=rtol, atol=rtol, err_msg=backend
    )


def test_host_kernel_sig_equals_reference() -> None:
    from traintape.core import native
    from traintape.core.stats import raw_rows

    if not native.fused_available():
        pytest.skip("no C compiler: the host kernel is the numpy reference")
    cases = _layout_cases()
    _check(raw_rows([x for x, *_ in cases], maps=[m for _, m, *_ in cases]), "C kernel")


def test_jax_sig_equals_reference() -> None:
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    from traintape.adapters.jax import ffi_kernel
    from traintape.adapters.jax.stats import decode_raw, raw_matrix

    allc = _layout_cases()
    idx = [i for i, (x, *_) in enumerate(allc) if x.dtype == np.float32]  # JAX: no x64
    maps = tuple(allc[i][1] for i in idx)
    xs = [jnp.asarray(allc[i][0]) for i in idx]
    want = _sig_of_rows(reference_raw_rows([x for x, *_ in allc], [m for _, m, *_ in allc]))[idx]
    xla = decode_raw(np.asarray(jax.jit(raw_matrix, static_argnums=1)(xs, maps)))
    np.testing.assert_allclose(_sig_of_rows(xla), want, rtol=1e-5, atol=1e-5, err_msg="xla")
    if ffi_kernel.available():
        ffi = ffi_kernel.decode(np.asarray(jax.jit(lambda a: ffi_kernel.raw_rows(a, maps))(xs)))
        np.testing.assert_allclose(_sig_of_rows(ffi), want, rtol=1e-5, atol=1e-5, err_msg="ffi")


@pytest.mark.parametrize("fused", [True, False])
def test_torch_sig_equals_reference(monkeypatch, fused: bool) -> None:
    torch = pytest.importorskip("torch")
    from traintape.adapters.torch import stats as S

    if not fused:
        monkeypatch.setattr(S, "_fused_ok", lambda: False)
    cases = _layout_cases()
    raw = S.raw_stats([torch.from_numpy(x) for x, *_ in cases], [m for _, m, *_ in cases])
    _check(raw.numpy(), f"torch (fused={fused})")


def test_tf_sig_equals_reference() -> None:
    tf = pytest.importorskip("tensorflow")
    from traintape.adapters.tf import stats as S

    cases = _layout_cases()
    maps = [m for _, m, *_ in cases]
    graph = S.raw_matrix([tf.constant(x) for x, *_ in cases], maps).numpy()
    _check(graph, "tf graph")
    host = S.host_raw_matrices([[x for x, *_ in cases]], [maps])[0]
    _check(host, "tf host")
    # a canonical activation with a dynamic batch: the per-example index, batch free
    act = np.random.default_rng(1).normal(size=(5, 7, 3)).astype(np.float32)
    f = tf.function(
        lambda t: S.raw_matrix([t], batch_free=True),
        input_signature=[tf.TensorSpec([None, 7, 3], tf.float32)],
    )
    want = reference_raw_rows([act], [index_map(act.shape, batch=True)])
    np.testing.assert_allclose(
        _sig_of_rows(f(tf.constant(act)).numpy()), _sig_of_rows(want), rtol=1e-5
    )


def test_row_block_shards_merge_to_the_whole() -> None:
    """FSDP2-like dim-0 shards of a torch Linear weight (out, in), uneven (torch.chunk),
    each reduced with its offset, merge (torch and numpy) to the whole tensor's row."""
    torch = pytest.importorskip("torch")
    from traintape.adapters.torch import stats as S

    w = torch.randn(37, 24, generator=torch.Generator().manual_seed(3))
    whole_map = index_map(tuple(w.shape), (1, 0))
    want = S.raw_stats([w], [whole_map])[0]
    for fused in (True, False):
        chunks, start, rows = w.chunk(4, dim=0), 0, []
        for c in chunks:
            m = index_map(tuple(w.shape), (1, 0), start=(start, 0))
            if fused:
                rows.append(S.raw_stats([c], [m])[0])
            else:
                rows.append(torch.from_numpy(reference_raw_rows([c.numpy()], [m])[0]))
            start += c.shape[0]
        acc = rows[0]
        for r in rows[1:]:
            acc = merge(acc, r, torch)
        np.testing.assert_allclose(
            finalize(acc.numpy()), finalize(want.numpy()), rtol=1e-5, atol=1e-7
        )


def test_activation_micro_batches_merge_to_the_whole_batch() -> None:
    """The pattern runs over the per-example index: micro-batches merge exactly, and the
    merged row is the whole batch's."""
    x = np.random.default_rng(2).normal(size=(12, 4, 3, 3)).astype(np.float32)  # NCHW
    perm = (0, 2, 3, 1)
    parts = [x[:5], x[5:6], x[6:]]
    rows = reference_raw_rows(parts, [index_map(p.shape, perm, batch=True) for p in parts])
    acc = rows[0]
    for r in rows[1:]:
        acc = merge(acc, r)
    want = reference_stats([x.transpose(perm)], [index_map((12, 3, 3, 4), batch=True)])[0]
    np.testing.assert_allclose(finalize(acc), want, rtol=1e-9)


def test_torch_linear_and_canonical_kernel_record_the_same_sig(tmp_path) -> None:
    """A torch Linear recorded by ``watch`` (weight held (out, in)) and its canonical
    kernel recorded by the plain Recorder and the JAX adapter (the Flax layout (in, out))
    give the same sig; the transposed kernel does not."""
    torch = pytest.importorskip("torch")
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    import traintape.jax as tj
    import traintape.torch as tto

    lin = torch.nn.Linear(6, 6)
    kernel = lin.weight.detach().numpy().T.copy()  # canonical (in, out)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    pol = tt.CapturePolicy(kinds=("param",))
    with (
        tt.Recorder(str(tmp_path / "torch"), policy=pol) as rec,
        tto.watch(lin, rec, optimizer=opt),
    ):
        lin(torch.ones(2, 6)).sum().backward()
        opt.step()
    with tt.Recorder(str(tmp_path / "plain")) as rec:
        rec.record(0, "param", {"kernel": kernel, "kernel_t": kernel.T.copy()})
    jrec = tt.Recorder(str(tmp_path / "jax"))
    params = {"dense": {"kernel": jnp.asarray(kernel)}}
    vg = tj.value_and_grad(lambda p: jnp.sum(p["dense"]["kernel"] * 0.5), recorder=jrec)
    jax.jit(vg)(params)
    jrec.close()

    def sig(path: str, kind: str, tensor: str) -> float:
        df = tt.open_run(str(tmp_path / path)).stats(kind)
        return float(df[(df.tensor == tensor) & (df.step == 0)]["sig"].iloc[0])

    want = sig("plain", "param", "kernel")
    assert sig("torch", "param", "kernel") == pytest.approx(want, rel=1e-6, abs=1e-7)
    assert sig("jax", "param", "dense/kernel") == pytest.approx(want, rel=1e-6, abs=1e-7)
    assert abs(sig("plain", "param", "kernel_t") - want) > 1e-3
