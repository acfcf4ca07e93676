"""Equinox through traintape.jax: canonical layouts (checked against equinox's own
weights/grads and PyTorch's layouts), ``filter_value_and_grad`` (activations under
vmap included), and the transposed square-kernel negative control."""

from __future__ import annotations

import numpy as np
import pytest

eqx = pytest.importorskip("equinox")
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import traintape.jax as tj  # noqa: E402
from traintape.core import Recorder, open_run  # noqa: E402
from traintape.schema import CapturePolicy  # noqa: E402


class Net(eqx.Module):
    conv: eqx.nn.Conv2d
    emb: eqx.nn.Embedding
    ln: eqx.nn.LayerNorm
    rms: eqx.nn.RMSNorm
    lin: eqx.nn.Linear

    def __init__(self, key: jax.Array) -> None:
        k = jax.random.split(key, 3)
        self.conv = eqx.nn.Conv2d(2, 3, (3, 2), key=k[0])
        self.emb = eqx.nn.Embedding(5, 3, key=k[1])
        self.ln = eqx.nn.LayerNorm(3)
        self.rms = eqx.nn.RMSNorm(3)
        self.lin = eqx.nn.Linear(3, 2, key=k[2])

    def __call__(self, x: jax.Array, tok: jax.Array) -> jax.Array:
        h = self.conv(x).mean(axis=(1, 2)) + self.emb(tok)  # (3,)
        return self.lin(self.rms(self.ln(h)))


def _loss(m: Net, x: jax.Array, tok: jax.Array) -> jax.Array:
    return jnp.sum(m(x, tok) ** 2)


def _args() -> tuple[Net, jax.Array, jax.Array]:
    x = jax.random.normal(jax.random.PRNGKey(1), (2, 6, 5))
    return Net(jax.random.PRNGKey(0)), x, jnp.asarray(2)


def _canon(m: Net) -> dict[str, np.ndarray]:
    """The canonical layout by roles.py's rules, written out by hand."""
    return {
        "conv/kernel": np.asarray(m.conv.weight).transpose(2, 3, 1, 0),
        "conv/bias": np.asarray(m.conv.bias).reshape(-1),
        "emb/embedding": np.asarray(m.emb.weight),
        "ln/scale": np.asarray(m.ln.weight),
        "ln/bias": np.asarray(m.ln.bias),
        "rms/scale": np.asarray(m.rms.weight),
        "rms/bias": np.asarray(m.rms.bias),
        "lin/kernel": np.asarray(m.lin.weight).T,
        "lin/bias": np.asarray(m.lin.bias),
    }


def test_filter_value_and_grad_canonical_params_grads_specs(mem_url):
    model, x, tok = _args()
    want_v, want_g = eqx.filter_jit(eqx.filter_value_and_grad(_loss))(model, x, tok)
    rec = Recorder(mem_url, CapturePolicy(full_every=1))
    with rec:
        v, g = eqx.filter_jit(tj.filter_value_and_grad(_loss, recorder=rec))(model, x, tok)
    np.testing.assert_allclose(v, want_v, rtol=1e-6)
    assert jax.tree_util.tree_structure(g) == jax.tree_util.tree_structure(want_g)
    for a, b in zip(jax.tree_util.tree_leaves(g), jax.tree_util.tree_leaves(want_g), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    run = open_run(mem_url)
    want_p, want_gc = _canon(model), _canon(want_g)
    assert sorted(run.tensor_names("param")) == sorted(want_p)
    for name in want_p:
        np.testing.assert_allclose(run.snapshot(name, "param", 0), want_p[name], rtol=1e-6)
        np.testing.assert_allclose(run.snapshot(name, "grad", 0), want_gc[name], rtol=1e-5,
                                   atol=1e-6)  # fmt: skip
    s = run.spec("lin/kernel", "param")
    assert (s.permutation, s.source_shape, s.shape, s.layer_kind) == ([1, 0], [2, 3], [3, 2],
                                                                      "dense")  # fmt: skip
    s = run.spec("conv/kernel", "param")
    assert s.permutation == [2, 3, 1, 0] and s.source_shape == [3, 2, 3, 2]
    assert s.shape == [3, 2, 2, 3] and s.layer_kind == "conv"
    s = run.spec("conv/bias", "param")
    assert s.source_shape == [3, 1, 1] and s.shape == [3] and s.permutation is None
    assert run.spec("ln/scale", "param").layer_kind == "layer_norm"
    assert run.spec("rms/scale", "param").layer_kind == "rms_norm"
    assert run.spec("emb/embedding", "param").layer_kind == "embedding"


def test_conv_layout_is_torch_conv2d():
    torch = pytest.importorskip("torch")
    import traintape.torch as tt

    model, x, _ = _args()
    rec_leaves = {lf.name: lf for lf in tj.named_leaves(eqx.filter(model, eqx.is_array))}
    leaves = jax.tree_util.tree_leaves(eqx.filter(model, eqx.is_array))
    canon = {n: np.array(lf.canonical(leaves[lf.index])) for n, lf in rec_leaves.items()}
    tconv = torch.nn.Conv2d(2, 3, (3, 2))
    wrapper = torch.nn.Module()
    wrapper.conv = tconv
    tt.from_canonical(wrapper, {k: v for k, v in canon.items() if k.startswith("conv/")})
    np.testing.assert_array_equal(tconv.weight.detach().numpy(), np.asarray(model.conv.weight))
    np.testing.assert_array_equal(tconv.bias.detach().numpy(), np.asarray(model.conv.bias)[:, 0, 0])
    want = np.asarray(model.conv(x))
    got = tconv(torch.from_numpy(np.asarray(x))[None])[0].detach().numpy()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_jax_jit_and_partition_with_plain_value_and_grad(mem_url):
    model, x, tok = _args()
    params, static = eqx.partition(model, eqx.is_inexact_array)
    want_v, want_g = jax.jit(jax.value_and_grad(lambda p: _loss(eqx.combine(p, static), x, tok)))(
        params
    )
    rec = Recorder(mem_url, CapturePolicy(full_every=1))
    with rec:
        vg = tj.value_and_grad(lambda p: _loss(eqx.combine(p, static), x, tok), recorder=rec)
        v, g = jax.jit(vg)(params)
        fv, fg = jax.jit(tj.filter_value_and_grad(
            lambda p: _loss(eqx.combine(p, static), x, tok), recorder=Recorder(mem_url + "b")
        ))(params)  # fmt: skip
    np.testing.assert_allclose(v, want_v, rtol=1e-6)
    np.testing.assert_allclose(fv, want_v, rtol=1e-6)
    for a, b, c in zip(*(jax.tree_util.tree_leaves(t) for t in (g, fg, want_g)), strict=True):
        np.testing.assert_allclose(a, c, rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(b, c, rtol=1e-5, atol=1e-7)
    run = open_run(mem_url)
    want_p = _canon(model)
    for name in want_p:
        np.testing.assert_allclose(run.snapshot(name, "param", 0), want_p[name], rtol=1e-6)
    assert run.spec("ln/scale", "param").layer_kind == "layer_norm"
    assert run.spec("lin/kernel", "grad").permutation == [1, 0]


def test_mha_and_recurrent_names():
    k = jax.random.split(jax.random.PRNGKey(0), 3)
    tree = {
        "attn": eqx.nn.MultiheadAttention(2, 4, key=k[0]),
        "lstm": eqx.nn.LSTMCell(3, 5, key=k[1]),
        "gru": eqx.nn.GRUCell(3, 5, key=k[2]),
    }
    leaves = {lf.name: lf for lf in tj.named_leaves(eqx.filter(tree, eqx.is_array))}
    assert leaves["attn/q/kernel"].shape == (4, 4)
    assert leaves["attn/o/kernel"].permutation == (1, 0)
    assert leaves["lstm/kernel_ih"].shape == (3, 20) and leaves["lstm/kernel_hh"].shape == (5, 20)
    assert leaves["lstm/bias_ih"].shape == (20,)
    assert leaves["gru/kernel_ih"].shape == (3, 15) and leaves["gru/kernel_hh"].shape == (5, 15)
    # GRUCell.bias = b_i + [b_hr, b_hz, 0] → bias_ih; bias_n = b_hn → bias_hn
    assert leaves["gru/bias_ih"].shape == (15,) and leaves["gru/bias_hn"].shape == (5,)
    assert leaves["gru/bias_hn"].source_name == "gru/bias_n"
    assert "lstm/bias_hh" not in leaves and "gru/bias_hh" not in leaves
    bn, _ = eqx.nn.make_with_state(eqx.nn.BatchNorm)(3, "batch", mode="batch")
    names = {lf.name: lf.layer_kind for lf in tj.named_leaves(eqx.filter({"bn": bn}, eqx.is_array))}
    assert names == {"bn/scale": "batch_norm", "bn/bias": "batch_norm"}


def _torch_gru_step(x, h, k_ih, k_hh, b_ih, b_hh):  # type: ignore[no-untyped-def]
    """PyTorch's GRU step on canonical tensors (gates r, z, n; ``kernel_*`` (in, 3H)):
    ``n = tanh(x W_in + b_in + r * (h W_hn + b_hn))``, ``h' = (1 - z) n + z h``."""
    ir, iz, in_ = np.split(x @ k_ih + b_ih, 3, axis=-1)
    hr, hz, hn = np.split(h @ k_hh + b_hh, 3, axis=-1)
    sig = lambda v: 1 / (1 + np.exp(-v))  # noqa: E731
    r, z = sig(ir + hr), sig(iz + hz)
    n = np.tanh(in_ + r * hn)
    return (1 - z) * n + z * h


def test_grucell_canonical_layout_is_its_own_math(mem_url):
    """``eqx.nn.GRUCell`` recorded canonically: ``weight_ih`` (3H, in) as ``kernel_ih``
    (in, 3H) and ``weight_hh`` as ``kernel_hh`` (H, 3H), gates r, z, n (torch's order);
    ``bias`` (3H) as ``bias_ih`` and ``bias_n`` (H) as ``bias_hn``. Checked against the
    cell's own math: PyTorch's GRU step on the recorded tensors, with ``b_ih`` = the
    recorded ``bias_ih`` and ``b_hh`` = [0, 0, ``bias_hn``] (the r/z hidden biases the
    cell folds into ``bias``), reproduces the cell over a sequence; the recorded params
    and grads are the cell's own, in that layout (specs: permutation, layer kind)."""
    hid, fin, steps = 5, 3, 4
    k = jax.random.split(jax.random.PRNGKey(0), 4)
    cell = eqx.nn.GRUCell(fin, hid, key=k[0])
    # random biases (equinox initialises them uniform too; make sure none is zero)
    cell = eqx.tree_at(lambda c: (c.bias, c.bias_n), cell,
                       (jax.random.normal(k[1], (3 * hid,)), jax.random.normal(k[2], (hid,))))  # fmt: skip
    xs = jax.random.normal(k[3], (2, steps, fin))

    def run(c, x):  # type: ignore[no-untyped-def]
        h = jnp.zeros(hid)
        for t in range(steps):
            h = c(x[t], h)
        return h

    leaves = {lf.name: lf for lf in tj.named_leaves(eqx.filter(cell, eqx.is_array))}
    flat = jax.tree_util.tree_leaves(eqx.filter(cell, eqx.is_array))
    canon = {n: np.asarray(lf.canonical(flat[lf.index])) for n, lf in leaves.items()}
    assert sorted(canon) == ["bias_hn", "bias_ih", "kernel_hh", "kernel_ih"]
    np.testing.assert_array_equal(canon["kernel_ih"], np.asarray(cell.weight_ih).T)
    np.testing.assert_array_equal(canon["kernel_hh"], np.asarray(cell.weight_hh).T)
    np.testing.assert_array_equal(canon["bias_ih"], np.asarray(cell.bias))
    np.testing.assert_array_equal(canon["bias_hn"], np.asarray(cell.bias_n))
    b_hh = np.concatenate([np.zeros(2 * hid, np.float32), canon["bias_hn"]])
    h = np.zeros((2, hid), np.float32)
    for t in range(steps):
        h = _torch_gru_step(np.asarray(xs[:, t]), h, canon["kernel_ih"], canon["kernel_hh"],
                            canon["bias_ih"], b_hh)  # fmt: skip
    np.testing.assert_allclose(jax.vmap(lambda x: run(cell, x))(xs), h, rtol=1e-5, atol=1e-6)

    # recorded: the cell's params and grads in that layout
    def loss(m):  # type: ignore[no-untyped-def]
        return jnp.sum(jax.vmap(lambda x: run(m["gru"], x))(xs) ** 2)

    _, want_g = eqx.filter_jit(eqx.filter_value_and_grad(loss))({"gru": cell})
    with Recorder(mem_url, CapturePolicy(full_every=1)) as rec:
        eqx.filter_jit(tj.filter_value_and_grad(loss, recorder=rec))({"gru": cell})
    r = open_run(mem_url)
    g = want_g["gru"]
    want_grad = {"kernel_ih": np.asarray(g.weight_ih).T, "kernel_hh": np.asarray(g.weight_hh).T,
                 "bias_ih": np.asarray(g.bias), "bias_hn": np.asarray(g.bias_n)}  # fmt: skip
    assert sorted(r.tensor_names("param")) == [f"gru/{n}" for n in sorted(canon)]
    for n in canon:
        np.testing.assert_array_equal(r.snapshot(f"gru/{n}", "param", 0), canon[n])
        np.testing.assert_allclose(r.snapshot(f"gru/{n}", "grad", 0), want_grad[n], rtol=1e-5,
                                   atol=1e-6)  # fmt: skip
        spec = r.spec(f"gru/{n}", "param")
        assert spec.layer_kind == "gru" and spec.role == n
        assert spec.permutation == ([1, 0] if n.startswith("kernel") else None)
    assert r.spec("gru/kernel_ih", "param").source_shape == [3 * hid, fin]
    assert r.spec("gru/bias_hn", "param").source_name == "gru/bias_n"


class _Block(eqx.Module):
    """Per-example model: tokens (T,) → (T, 2), layers mapped over tokens."""

    emb: eqx.nn.Embedding
    attn: eqx.nn.MultiheadAttention
    mix: eqx.nn.Linear
    out: eqx.nn.Linear

    def __init__(self, key: jax.Array) -> None:
        k = jax.random.split(key, 4)
        self.emb = eqx.nn.Embedding(7, 4, key=k[0])
        self.attn = eqx.nn.MultiheadAttention(2, 4, key=k[1])
        self.mix = eqx.nn.Linear(4, 3, key=k[2])
        self.out = eqx.nn.Linear(3, 2, key=k[3])

    def __call__(self, ids: jax.Array) -> jax.Array:
        x = jax.vmap(self.emb)(ids)
        x = x + self.attn(x, x, x)
        return jax.vmap(self.out)(jnp.tanh(jax.vmap(self.mix)(x)))


def test_activations_under_nested_vmap(mem_url):
    """Layer outputs taken inside vmap(batch) ∘ vmap(tokens) are recorded (B, T, ...):
    their stats are those of the outputs computed directly; the attention is one layer
    (no q/k/v/o outputs); forward order; grads unchanged by the capture."""
    model = _Block(jax.random.PRNGKey(0))
    ids = jax.random.randint(jax.random.PRNGKey(1), (5, 6), 0, 7)

    def loss(m: _Block, x: jax.Array) -> jax.Array:
        return jnp.mean(jax.vmap(m)(x) ** 2)

    want_v, want_g = eqx.filter_value_and_grad(loss)(model, ids)
    with Recorder(mem_url, CapturePolicy()) as rec:
        v, g = eqx.filter_jit(tj.filter_value_and_grad(loss, recorder=rec))(model, ids)
    np.testing.assert_allclose(v, want_v, rtol=1e-6)
    for a, b in zip(jax.tree_util.tree_leaves(g), jax.tree_util.tree_leaves(want_g), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    run = open_run(mem_url)
    acts = ["emb/output", "attn/output", "mix/output", "out/output"]
    assert run.tensor_names("activation") == sorted(acts)
    assert run.manifest.forward_order == ["emb", "attn", "mix", "out"]
    x = jax.vmap(jax.vmap(model.emb))(ids)
    a = jax.vmap(lambda e: model.attn(e, e, e))(x)
    h = jax.vmap(jax.vmap(model.mix))(x + a)
    direct = {"emb/output": x, "attn/output": a, "mix/output": h,
              "out/output": jax.vmap(jax.vmap(model.out))(jnp.tanh(h))}  # fmt: skip
    st = run.stats("activation")
    for name, value in direct.items():
        spec = run.spec(name, "activation")
        assert spec.shape == [None, *value.shape[1:]], name
        row = st[(st.tensor == name) & (st.step == 0)].iloc[0]
        np.testing.assert_allclose(row["mean"], np.mean(value), rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(row["l2"], np.linalg.norm(np.asarray(value)), rtol=1e-5)
    assert run.spec("attn/output", "activation").layer_kind == "attention"
    assert run.spec("mix/output", "activation").layer_kind == "dense"


def test_activation_capture_leaves_classes_alone(mem_url):
    """The capture patches layer classes only while the function runs; a plain call
    afterwards is equinox's own, and activations=False records none."""
    model = eqx.nn.MLP(3, 2, 4, 1, key=jax.random.PRNGKey(0))
    before = eqx.nn.Linear.__call__
    x = jnp.ones((2, 3))
    with Recorder(mem_url, CapturePolicy()) as rec:
        tj.filter_value_and_grad(lambda m: jnp.sum(jax.vmap(m)(x)), recorder=rec)(model)
    assert eqx.nn.Linear.__call__ is before
    assert open_run(mem_url).tensor_names("activation") == ["layers/0/output", "layers/1/output"]
    with Recorder(mem_url + "b", CapturePolicy()) as rec:
        tj.filter_value_and_grad(
            lambda m: jnp.sum(jax.vmap(m)(x)), recorder=rec, activations=False
        )(model)
    assert open_run(mem_url + "b").tensor_names("activation") == []


def _train_pair(url_eqx: str, url_torch: str, *, bad: bool) -> None:
    """Train the same square-kernel MLP in equinox and torch (3 SGD steps) and record
    both. ``bad``: the equinox run is recorded the pre-fix way, weights untransposed
    under the canonical name ``kernel`` (a plain dict of equinox's raw arrays)."""
    torch = pytest.importorskip("torch")
    import traintape.torch as tt

    model = eqx.nn.MLP(4, 4, 4, 1, key=jax.random.PRNGKey(0))
    x = jax.random.normal(jax.random.PRNGKey(1), (8, 4))

    def loss(m: eqx.nn.MLP) -> jax.Array:
        return jnp.mean(jax.vmap(m)(x) ** 2)

    class TMLP(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.ModuleList([torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)])

        def forward(self, h):  # type: ignore[no-untyped-def]
            return self.layers[1](torch.relu(self.layers[0](h)))

    tm = TMLP()
    canon = {f"layers/{i}/kernel": np.array(lay.weight).T for i, lay in enumerate(model.layers)}
    canon |= {f"layers/{i}/bias": np.array(lay.bias) for i, lay in enumerate(model.layers)}
    tt.from_canonical(tm, canon)
    opt = torch.optim.SGD(tm.parameters(), lr=0.1)
    tx = torch.from_numpy(np.asarray(x))
    pol = CapturePolicy(full_every=1)
    with Recorder(url_torch, pol) as rec, tt.watch(tm, rec, optimizer=opt):
        for _ in range(3):
            opt.zero_grad()
            (tm(tx) ** 2).mean().backward()
            opt.step()

    with Recorder(url_eqx, pol) as rec:
        if not bad:
            vg = eqx.filter_jit(tj.filter_value_and_grad(loss, recorder=rec))
            for _ in range(3):
                _, g = vg(model)
                model = eqx.apply_updates(model, jax.tree_util.tree_map(lambda d: -0.1 * d, g))
        else:

            def raw_loss(p):  # type: ignore[no-untyped-def]
                # the same MLP, weights in equinox's (out, in) layout named "kernel"
                w0, w1 = p["layers"]
                h = jax.nn.relu(x @ w0["kernel"].T + w0["bias"])
                return jnp.mean((h @ w1["kernel"].T + w1["bias"]) ** 2)

            params = {"layers": [{"kernel": lay.weight, "bias": lay.bias} for lay in model.layers]}
            vg = jax.jit(tj.value_and_grad(raw_loss, recorder=rec))
            for _ in range(3):
                _, g = vg(params)
                params = jax.tree_util.tree_map(lambda p, d: p - 0.1 * d, params, g)


def test_negative_control_transposed_square_kernel(tmp_path):
    from traintape.analysis import compare

    good, bad, ref = (str(tmp_path / n) for n in ("good", "bad", "torch"))
    _train_pair(good, ref, bad=False)
    _train_pair(bad, str(tmp_path / "torch2"), bad=True)
    ok = compare(good, ref)
    assert ok.identical, ok
    assert {d.tensor for d in ok.tensors if d.kind == "param"} >= {"layers/0/kernel"}
    assert all(d.snapshots_compared > 0 for d in ok.tensors if d.tensor.endswith("kernel"))
    ko = compare(bad, ref)
    assert not ko.identical
    out = {(d.tensor, d.kind) for d in ko.tensors if d.first_step_out is not None}
    assert ("layers/0/kernel", "param") in out and ("layers/1/kernel", "param") in out
    assert all(d.first_step_out == 0 for d in ko.tensors
               if d.tensor.endswith("kernel") and d.kind == "param")  # fmt: skip


def test_watch_update_and_opt_state_canonical(mem_url):
    optax = pytest.importorskip("optax")
    model = eqx.nn.MLP(3, 2, 4, 1, key=jax.random.PRNGKey(0))
    x = jax.random.normal(jax.random.PRNGKey(1), (5, 3))
    params = eqx.filter(model, eqx.is_inexact_array)
    grads = eqx.filter_grad(lambda m: jnp.mean(jax.vmap(m)(x) ** 2))(model)
    want_u, want_s = optax.adam(1e-2).update(grads, optax.adam(1e-2).init(params), params)
    rec = Recorder(
        mem_url,
        CapturePolicy(
            kinds=("update", "opt_state"), full_every=1, snapshot_kinds=("update", "opt_state")
        ),
    )
    with rec:
        tx = tj.watch(optax.adam(1e-2), rec, kinds=("update", "opt_state"))
        u, _ = eqx.filter_jit(tx.update)(grads, tx.init(params), params)
    run = open_run(mem_url)
    for i, lay in enumerate(want_u.layers):
        np.testing.assert_allclose(np.asarray(u.layers[i].weight), lay.weight, rtol=1e-6)
        got = run.snapshot(f"layers/{i}/kernel", "update", 0)
        np.testing.assert_allclose(got, np.asarray(lay.weight).T, rtol=1e-5, atol=1e-8)
        spec = run.spec(f"layers/{i}/kernel", "update")
        assert spec.permutation == [1, 0]
        mu = np.asarray(want_s[0].mu.layers[i].weight).T
        np.testing.assert_allclose(
            run.snapshot(f"layers/{i}/kernel/mu", "opt_state", 0), mu, rtol=1e-5, atol=1e-8
        )


def test_cell_under_lax_scan_is_not_leaked(mem_url):
    """A GRUCell stepped by ``lax.scan`` runs in the scan body's own trace: its output
    cannot leave it, so it is not recorded (no leaked tracer); the head after the scan
    is. A cell stepped by a Python loop records its first call (step 0 of the loop)."""
    k = jax.random.split(jax.random.PRNGKey(0), 2)
    model = {"gru": eqx.nn.GRUCell(3, 4, key=k[0]), "head": eqx.nn.Linear(4, 1, key=k[1])}
    xs = jax.random.normal(jax.random.PRNGKey(1), (2, 5, 3))

    def run_scan(m, x):  # type: ignore[no-untyped-def]
        h, _ = jax.lax.scan(lambda h, xt: (m["gru"](xt, h), None), jnp.zeros(4), x)
        return m["head"](h)

    def run_loop(m, x):  # type: ignore[no-untyped-def]
        h = jnp.zeros(4)
        for t in range(x.shape[0]):
            h = m["gru"](x[t], h)
        return m["head"](h)

    for i, fwd in enumerate((run_scan, run_loop)):
        url = f"{mem_url}{i}"
        with Recorder(url, CapturePolicy()) as rec:
            vg = tj.filter_value_and_grad(
                lambda m, f=fwd: jnp.sum(jax.vmap(lambda x: f(m, x))(xs)), recorder=rec
            )
            eqx.filter_jit(vg)(model)
        acts = open_run(url).tensor_names("activation")
        assert acts == (["head/output"] if fwd is run_scan else ["gru/output", "head/output"])
    assert open_run(f"{mem_url}1").spec("gru/output", "activation").shape == [None, 4]


class _ConvBN(eqx.Module):
    conv: eqx.nn.Conv2d
    bn: eqx.nn.BatchNorm

    def __init__(self, key: jax.Array) -> None:
        self.conv = eqx.nn.Conv2d(2, 3, 3, padding=1, use_bias=False, key=key)
        self.bn = eqx.nn.BatchNorm(3, "batch", mode="batch")

    def __call__(self, x: jax.Array, state: eqx.nn.State) -> tuple[jax.Array, eqx.nn.State]:
        return self.bn(self.conv(x), state)


def test_conv_batch_norm_channels_last_and_state(mem_url):
    """Conv/BatchNorm outputs (channel-first per example) are recorded channels-last;
    the BatchNorm statistics of the State passed in are ``param`` running_mean/var as
    passed (θ_t), layer kind batch_norm."""
    model, state = eqx.nn.make_with_state(_ConvBN)(jax.random.PRNGKey(0))
    mean0 = jnp.asarray([0.5, -1.0, 2.0])
    state = state.set(model.bn.batch_state_index, (mean0, jnp.ones(3)))
    x = jax.random.normal(jax.random.PRNGKey(1), (4, 2, 5, 6))  # (B, C, H, W)

    def loss(m, st, xb):  # type: ignore[no-untyped-def]
        y, st = jax.vmap(m, axis_name="batch", in_axes=(0, None), out_axes=(0, None))(xb, st)
        return jnp.mean(y**2), st

    with Recorder(mem_url, CapturePolicy(full_every=1)) as rec:
        vg = eqx.filter_jit(tj.filter_value_and_grad(loss, recorder=rec, has_aux=True))
        (_, new_state), _ = vg(model, state, x)
    run = open_run(mem_url)
    assert run.spec("conv/output", "activation").shape == [None, 5, 6, 3]
    assert run.spec("bn/output", "activation").shape == [None, 5, 6, 3]
    direct = jax.vmap(model.conv)(x)  # (B, 3, 5, 6)
    row = run.stats("activation")
    row = row[(row.tensor == "conv/output") & (row.step == 0)].iloc[0]
    np.testing.assert_allclose(row["l2"], np.linalg.norm(np.asarray(direct)), rtol=1e-5)
    np.testing.assert_array_equal(run.snapshot("bn/running_mean", "param", 0), mean0)
    np.testing.assert_array_equal(run.snapshot("bn/running_var", "param", 0), np.ones(3))
    assert run.spec("bn/running_mean", "param").layer_kind == "batch_norm"
    assert run.spec("bn/scale", "param").layer_kind == "batch_norm"
    assert not np.allclose(new_state.get(model.bn.batch_state_index)[0], mean0)  # it moved
