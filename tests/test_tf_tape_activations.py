"""The TF custom loop records activations when ``model=`` is given, with the names the
Keras ``fit`` callback uses, eagerly and inside ``tf.function``; the values are the
layers' own outputs on the training batch."""

from __future__ import annotations

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

import traintape  # noqa: E402
from traintape.tf import GradientTape  # noqa: E402


def _model() -> keras.Model:
    keras.utils.set_random_seed(0)
    inp = keras.Input((4,))
    h = keras.layers.Dense(8, activation="tanh", name="fc1")(inp)
    h = keras.layers.BatchNormalization(name="bn")(h)
    out = keras.layers.Dense(1, name="fc2")(h)
    return keras.Model(inp, out)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "tf.function"])
def test_custom_loop_records_activations(tmp_path, compiled: bool) -> None:
    m = _model()
    opt = keras.optimizers.SGD(0.01)
    rng = np.random.default_rng(0)
    xs = [rng.normal(size=(6, 4)).astype(np.float32) for _ in range(3)]
    y = np.zeros((6, 1), np.float32)
    url = str(tmp_path / "run")
    # the layer outputs the model computes on each training batch, read independently
    probe = keras.Model(m.input, [m.get_layer(n).output for n in ("fc1", "bn", "fc2")])
    want = []
    with traintape.Recorder(url) as rec:

        def step(x):
            with GradientTape(rec, model=m, optimizer=opt) as tape:
                loss = tf.reduce_mean((m(x, training=True) - y) ** 2)
            grads = tape.gradient(loss, m.trainable_variables)
            opt.apply_gradients(zip(grads, m.trainable_variables, strict=True))
            return loss

        fn = tf.function(step) if compiled else step
        for x in xs:
            outs = probe(x, training=True)  # same weights and batch statistics as the step
            want.append([o.numpy() for o in outs])
            fn(tf.constant(x))
    run = traintape.open_run(url)
    assert run.tensor_names("activation") == ["bn/output", "fc1/output", "fc2/output"]
    assert run.manifest.forward_order == ["fc1", "bn", "fc2"]
    df = run.stats("activation")
    for t, outs in enumerate(want):
        for name, o in zip(("fc1/output", "bn/output", "fc2/output"), outs, strict=True):
            row = df[(df.step == t) & (df.tensor == name)].iloc[0]
            assert row["l2"] == pytest.approx(float(np.linalg.norm(o)), rel=1e-4)
            assert row["max"] == pytest.approx(float(o.max()), rel=1e-5, abs=1e-6)


def test_no_model_no_activations(mem_url: str) -> None:
    m = _model()
    with traintape.Recorder(mem_url) as rec:
        with GradientTape(rec) as tape:
            loss = tf.reduce_sum(m(np.ones((2, 4), np.float32), training=True))
        tape.gradient(loss, m.trainable_variables)
    assert traintape.open_run(mem_url).tensor_names("activation") == []
