"""TensorFlow / Keras 3 adapter: names, layouts, stats, GradientTape, optimizer, fit."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

import traintape  # noqa: E402
import traintape.keras  # noqa: E402
from traintape.adapters.tf.stats import raw_matrix  # noqa: E402
from traintape.core.stats import stat_vectors  # noqa: E402
from traintape.schema.stats import N_RAW, activation_map, finalize  # noqa: E402
from traintape.tf import GradientTape, from_canonical, stat_matrix, to_canonical  # noqa: E402

try:
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
except RuntimeError:  # already initialised by another test module
    pass


def _run(url: str) -> traintape.Run:
    return traintape.open_run(url)


def test_stats_match_numpy_reference() -> None:
    rng = np.random.default_rng(0)
    a = rng.normal(size=(7, 5)).astype(np.float32)
    b = a.copy()
    b[0, 0], b[1, 1], b[2, 2], b[3, 3] = np.nan, np.inf, -np.inf, 0.0
    c = np.full((3,), np.nan, np.float32)
    big = rng.normal(0.1, 2.0, size=(300, 300)).astype(np.float32)  # fast all-finite path
    big_nan = big.copy()
    big_nan[5, :7] = np.nan  # fast path refused -> exact masked path
    big_shift = (1.0 + 1e-3 * rng.normal(size=(300, 300))).astype(np.float32)  # cancellation
    big_zero = np.where(big > 0, big, 0).astype(np.float32)
    arrays = [a, b, c, np.zeros((4,), np.float32), big, big_nan, big_shift, big_zero]
    ref = stat_vectors(arrays)
    got = stat_matrix([tf.constant(x) for x in arrays])
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6, equal_nan=True)
    graph = tf.function(lambda *xs: raw_matrix(list(xs)))(*[tf.constant(x) for x in arrays])
    np.testing.assert_allclose(finalize(graph.numpy()), ref, rtol=1e-5, atol=1e-6, equal_nan=True)
    dyn = tf.function(lambda x: raw_matrix([x]), input_signature=[tf.TensorSpec([None, 5])])
    np.testing.assert_allclose(finalize(dyn(tf.constant(b)).numpy())[0], ref[1], rtol=1e-6,
                               atol=1e-6)  # fmt: skip
    # host fused kernel: one call for several groups, eager tensors read without a copy
    from traintape.adapters.tf.stats import host_raw_matrices

    ts = [tf.constant(x) for x in arrays]
    m1, m2, m3 = host_raw_matrices([ts[:3], [], ts[3:]])
    assert m2.shape == (0, N_RAW)
    np.testing.assert_allclose(finalize(np.concatenate([m1, m3])), ref, rtol=1e-6, atol=1e-7,
                               equal_nan=True)  # fmt: skip
    sl = tf.IndexedSlices(tf.constant(a[:2]), tf.constant([0, 3]), tf.constant([5, 5]))
    np.testing.assert_allclose(finalize(host_raw_matrices([[sl]])[0]),
                               stat_vectors([tf.convert_to_tensor(sl).numpy()]), rtol=1e-6)  # fmt: skip


def _rich_model() -> keras.Model:
    inp = keras.Input((5, 6))
    x = keras.layers.LSTM(4, name="lstm", return_sequences=True)(inp)
    x = keras.layers.MultiHeadAttention(2, 3, name="mha")(x, x)
    x = keras.layers.GRU(4, name="gru", return_sequences=True)(x)
    x = keras.layers.Conv1D(3, 2, name="conv")(x)
    x = keras.layers.LayerNormalization(name="ln")(x)
    x = keras.layers.BatchNormalization(name="bn")(x)
    return keras.Model(inp, x, name="rich")


def test_names_layouts_and_from_canonical_round_trip() -> None:
    m = _rich_model()
    for v in m.variables:  # non-trivial values everywhere (biases, moving stats too)
        v.assign(np.random.default_rng(len(v.path)).normal(size=v.shape).astype(v.dtype))
    c = to_canonical(m)
    assert set(c) == {
        "lstm/kernel_ih", "lstm/kernel_hh", "lstm/bias_ih", "lstm/bias_hh",
        *(f"mha/{p}/{r}" for p in "qkvo" for r in ("kernel", "bias")),
        "gru/kernel_ih", "gru/kernel_hh", "gru/bias_ih", "gru/bias_hh",
        "conv/kernel", "conv/bias", "ln/scale", "ln/bias",
        "bn/scale", "bn/bias", "bn/running_mean", "bn/running_var",
    }  # fmt: skip
    assert c["mha/q/kernel"].shape == (4, 6) and c["mha/o/kernel"].shape == (6, 4)
    q = m.get_layer("mha").query_dense.kernel.numpy()  # (in, heads, head_dim)
    np.testing.assert_array_equal(c["mha/q/kernel"][:, 3:6], q[:, 1, :])
    gru = m.get_layer("gru").cell
    u = 4  # Keras z, r, h -> canonical r, z, n
    np.testing.assert_array_equal(c["gru/kernel_ih"][:, :u], gru.kernel.numpy()[:, u : 2 * u])
    np.testing.assert_array_equal(c["gru/bias_hh"][u : 2 * u], gru.bias.numpy()[1, :u])
    np.testing.assert_array_equal(c["bn/running_var"], m.get_layer("bn").moving_variance.numpy())
    # Keras's single LSTM bias = canonical bias_ih + bias_hh, recorded as (bias, zeros)
    np.testing.assert_array_equal(c["lstm/bias_ih"], m.get_layer("lstm").cell.bias.numpy())
    np.testing.assert_array_equal(c["lstm/bias_hh"], np.zeros(16, np.float32))

    m2 = _rich_model()
    from_canonical(m2, c)
    for a, b in zip(m.variables, m2.variables, strict=True):
        if "seed_generator" not in a.path:
            np.testing.assert_array_equal(a.numpy(), b.numpy(), err_msg=a.path)
    x = np.random.default_rng(1).normal(size=(2, 5, 6)).astype(np.float32)
    np.testing.assert_array_equal(m(x).numpy(), m2(x).numpy())
    # PyTorch-style LSTM bias_hh is summed into the single Keras bias
    hh = np.arange(16, dtype=np.float32)
    from_canonical(m2, dict(c, **{"lstm/bias_hh": hh}))
    np.testing.assert_array_equal(m2.get_layer("lstm").cell.bias.numpy(), c["lstm/bias_ih"] + hh)
    c3 = to_canonical(m2)
    np.testing.assert_array_equal(c3["lstm/bias_ih"], c["lstm/bias_ih"] + hh)
    np.testing.assert_array_equal(c3["lstm/bias_hh"], np.zeros(16, np.float32))
    # non-strict, bias_hh alone: added to the current Keras bias (it stands for bias_ih)
    from_canonical(m2, {"lstm/bias_hh": -hh}, strict=False)
    np.testing.assert_allclose(m2.get_layer("lstm").cell.bias.numpy(), c["lstm/bias_ih"],
                               rtol=1e-6, atol=1e-6)  # fmt: skip
    with pytest.raises(ValueError):
        from_canonical(m2, dict(c, **{"lstm/bias_hh": np.zeros(4, np.float32)}))
    with pytest.raises(KeyError):
        from_canonical(m2, {"lstm/kernel_ih": c["lstm/kernel_ih"]})
    nm = {"lstm/kernel_ih": "enc/lstm/kernel_ih"}
    cm = to_canonical(m, name_map=nm)
    assert "enc/lstm/kernel_ih" in cm and "lstm/kernel_ih" not in cm
    from_canonical(m2, cm, name_map=nm)


class _Blocks(keras.Model):
    """Subclassed model with a list of layers: index segments, Keras names dropped."""

    def __init__(self) -> None:
        super().__init__(name="blocks_model")
        self.blocks = [keras.layers.Dense(3, name="blk") for _ in range(2)]
        self.head = keras.layers.Dense(1, name="head")

    def call(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def test_subclassed_list_of_layers_gets_index_segments() -> None:
    m = _Blocks()
    m(np.zeros((1, 4), np.float32))
    names = [e.name for e in traintape.tf.model_entries(m)]
    assert names == ["blocks/0/kernel", "blocks/0/bias", "blocks/1/kernel", "blocks/1/bias",
                     "head/kernel", "head/bias"]  # fmt: skip


def _mlp() -> keras.Model:
    return keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(5, name="fc1"), keras.layers.Dense(2, name="fc2")]
    )


@pytest.mark.parametrize("opt_name", ["sgd", "adam"])
def test_tape_records_grads_params_updates_eager_and_function(mem_url: str, opt_name: str) -> None:
    keras.utils.set_random_seed(0)
    m = _mlp()
    opt = keras.optimizers.SGD(0.1) if opt_name == "sgd" else keras.optimizers.Adam(0.05)
    rng = np.random.default_rng(0)
    x = tf.constant(rng.normal(size=(8, 4)).astype(np.float32))
    y = tf.constant(rng.normal(size=(8, 2)).astype(np.float32))
    rec = traintape.Recorder(mem_url, traintape.CapturePolicy(full_every=1))

    def step():
        with GradientTape(rec, model=m, optimizer=opt) as tape:
            loss = tf.reduce_mean((m(x) - y) ** 2)
        g = tape.gradient(loss, m.trainable_variables)
        opt.apply_gradients(zip(g, m.trainable_variables, strict=True))
        return g

    fstep = tf.function(step)
    names = ["fc1/kernel", "fc1/bias", "fc2/kernel", "fc2/bias"]
    grads, params = [], [[v.numpy() for v in m.trainable_variables]]
    for i in range(4):
        g = (step if i < 2 else fstep)()
        grads.append([t.numpy() for t in g])
        params.append([v.numpy() for v in m.trainable_variables])
    rec.close()
    run = _run(mem_url)
    assert list(run.steps) == [0, 1, 2, 3]
    assert run.manifest.producer.framework == "tensorflow"
    for t in range(4):
        for j, n in enumerate(names):
            np.testing.assert_array_equal(run.snapshot(n, "grad", t), grads[t][j])
            np.testing.assert_array_equal(run.snapshot(n, "param", t), params[t][j])
            np.testing.assert_allclose(
                run.snapshot(n, "update", t), params[t + 1][j] - params[t][j], atol=1e-7
            )
    st = run.stats("grad")
    for t in (0, 3):
        rows = st[st.step == t].set_index("tensor").loc[names]
        ref = stat_vectors(grads[t])
        np.testing.assert_allclose(rows[list(traintape.STAT_NAMES)].to_numpy(), ref, rtol=1e-5,
                                   atol=1e-7)  # fmt: skip


def test_tape_without_optimizer_counts_steps_and_nan_is_not_fatal(mem_url: str) -> None:
    v = tf.Variable(np.ones((3,), np.float32), name="w")
    rec = traintape.Recorder(mem_url, traintape.CapturePolicy(every=2))

    @tf.function
    def step(scale):
        with GradientTape(rec) as tape:
            loss = tf.reduce_sum(v * scale)
        return tape.gradient(loss, [v])[0]

    for s in (1.0, np.nan, np.nan, 2.0):
        out = step(tf.constant(s, tf.float32))
    np.testing.assert_array_equal(out.numpy(), [2.0, 2.0, 2.0])
    rec.close()
    run = _run(mem_url)
    assert list(run.steps) == [0, 2]  # every=2: steps 1 and 3 skipped
    assert run.tensor_names("grad") == ["w"]
    st = run.stats("grad").set_index("step")
    assert st.loc[2, "nan_count"] == 3 and st.loc[0, "nan_count"] == 0
    ev = run.events()
    assert any(e.type == "nan" and e.tensor == "w" for e in ev), ev


def test_tape_in_function_lets_the_optimizer_update_in_place(mem_url: str) -> None:
    """The optimizer waits for the recording, so the θ_t buffers the host callback reads
    are released before the update: no copy-on-write of the variables."""
    vs = [tf.Variable(np.full((64, 64), 1.0 + i, np.float32), name=f"w{i}") for i in range(3)]
    opt = keras.optimizers.SGD(0.1)
    # no `update`: recording it copies θ_t on purpose (θ_{t+1} − θ_t needs both)
    rec = traintape.Recorder(mem_url, traintape.CapturePolicy(kinds=("param", "grad")))

    deps: list[set[str]] = []  # per traced gradient: op types of its control inputs + theirs

    def make(tape: Any) -> Any:
        @tf.function
        def step() -> None:
            with tape() as t:
                loss = tf.add_n([tf.reduce_sum(v * v) for v in vs])
            g = t.gradient(loss, vs)
            deps.extend({o.type for c in x.op.control_inputs for o in (c, *(i.op for i in c.inputs))}
                        for x in g)  # fmt: skip
            opt.apply_gradients(zip(g, vs, strict=True))

        return step

    def buffers() -> list[int]:
        return [np.asarray(v.read_value()).ctypes.data for v in vs]

    plain, recorded = make(tf.GradientTape), make(lambda: GradientTape(rec, optimizer=opt))
    plain()  # trace, build the optimizer
    before = buffers()
    plain()
    if buffers() != before:
        pytest.skip("this TensorFlow does not update variables in place")
    deps.clear()
    recorded()  # trace
    # the gradients handed to the optimizer exist only after the recording (its tf.cond)
    assert len(deps) == len(vs) and all(d & {"If", "StatelessIf"} for d in deps), deps
    before = buffers()
    recorded()
    assert buffers() == before
    rec.close()
    run = _run(mem_url)
    assert list(run.steps) == [2, 3]  # optimizer.iterations: two plain steps came first


class _Sub(keras.Model):
    def __init__(self) -> None:
        super().__init__(name="sub")
        self.fc1 = keras.layers.Dense(6, name="fc1")
        self.bn = keras.layers.BatchNormalization(name="bn")
        self.fc2 = keras.layers.Dense(1, name="fc2")

    def call(self, x, training=False):
        return self.fc2(self.bn(self.fc1(x), training=training))


def _seq() -> keras.Model:
    L = keras.layers
    return keras.Sequential([keras.Input((4,)), L.Dense(6, name="fc1"),
                             L.BatchNormalization(name="bn"), L.Dense(1, name="fc2")])  # fmt: skip


def _fun() -> keras.Model:
    inp = keras.Input((4,))
    h = keras.layers.BatchNormalization(name="bn")(keras.layers.Dense(6, name="fc1")(inp))
    return keras.Model(inp, keras.layers.Dense(1, name="fc2")(h))


def test_fit_callback_same_names_for_all_model_styles() -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 4)).astype(np.float32)
    y = rng.normal(size=(16, 1)).astype(np.float32)
    seen = {}
    for style, build in (("seq", _seq), ("fun", _fun), ("sub", _Sub)):
        m = build()
        m.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
        m(x[:2])
        w0 = {k: v.copy() for k, v in to_canonical(m).items()}
        url = f"memory://tf-fit-{style}"
        with traintape.Recorder(url, traintape.CapturePolicy(full_every=1)) as rec:
            cb = traintape.keras.Callback(rec, probe=x[:3])
            m.fit(x, y, batch_size=4, epochs=1, verbose=0, shuffle=False, callbacks=[cb])
        m.fit(x, y, batch_size=4, epochs=1, verbose=0)  # no stale trace into a closed recorder
        run = _run(url)
        assert list(run.steps) == [0, 1, 2, 3]
        names = {k: run.tensor_names(k) for k in ("param", "grad", "update", "activation")}
        seen[style] = names
        assert "bn/running_mean" in names["param"] and "bn/running_mean" not in names["grad"]
        assert names["activation"] == ["bn/output", "fc1/output", "fc2/output"]
        assert run.manifest.forward_order == ["fc1", "bn", "fc2"]  # call order
        # θ_0 is the initial weights (running stats before batch 0 included)
        for n in ("fc1/kernel", "bn/running_var", "bn/running_mean"):
            np.testing.assert_array_equal(run.snapshot(n, "param", 0), w0[n])
        # update(t) = param(t+1) - param(t)
        np.testing.assert_allclose(
            run.snapshot("fc1/kernel", "update", 0) + w0["fc1/kernel"],
            run.snapshot("fc1/kernel", "param", 2) - run.snapshot("fc1/kernel", "update", 1),
            atol=1e-6,
        )
        # activations: stats over training batch 0, snapshots of the probe batch, with θ_0
        k, b = w0["fc1/kernel"], w0["fc1/bias"]
        np.testing.assert_allclose(run.snapshot("fc1/output", "activation", 0), x[:3] @ k + b,
                                   rtol=1e-5, atol=1e-6)  # fmt: skip
        act = run.stats("activation")
        row = act[(act.step == 0) & (act.tensor == "fc1/output")]
        out = x[:4] @ k + b
        ref = stat_vectors([out], maps=[activation_map(out.shape)])[0]  # batch axis free
        np.testing.assert_allclose(row[list(traintape.STAT_NAMES)].to_numpy()[0], ref,
                                   rtol=1e-5, atol=1e-6)  # fmt: skip
        rm = run.stats("param")
        rm = rm[rm.tensor == "bn/running_mean"].set_index("step")
        assert rm.loc[0, "l2"] == 0.0 and rm.loc[1, "l2"] > 0  # moved after batch 0
        assert "loss" in run.metrics().columns and len(run.metrics()) == 4
        assert traintape.validate(url).ok
    assert seen["seq"] == seen["fun"] == seen["sub"]


def test_fit_every_2_skips_steps_and_update_is_theta_next_minus_theta(mem_url: str) -> None:
    rng = np.random.default_rng(1)
    x = rng.normal(size=(12, 4)).astype(np.float32)
    y = rng.normal(size=(12, 1)).astype(np.float32)
    m = _seq()
    m.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    pol = traintape.CapturePolicy(every=2, full_every=2, kinds=("param", "grad", "update"))
    with traintape.Recorder(mem_url, pol) as rec:
        m.fit(x, y, batch_size=4, epochs=1, verbose=0, shuffle=False,
              callbacks=[traintape.keras.Callback(rec)])  # fmt: skip
    run = _run(mem_url)
    assert list(run.steps) == [0, 2]
    assert run.tensor_names("activation") == []
    final = to_canonical(m)
    for n in ("fc1/kernel", "fc2/bias", "bn/scale"):
        np.testing.assert_allclose(
            run.snapshot(n, "update", 2), final[n] - run.snapshot(n, "param", 2), atol=1e-7
        )
