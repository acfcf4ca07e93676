"""Keras LSTM's single bias ↔ canonical ``bias_ih`` + ``bias_hh`` (PyTorch's two biases).

The Keras adapter records ``bias_ih`` = the Keras bias and ``bias_hh`` pinned at zero
(param 0, grad = the bias gradient, update 0), so a Keras LSTM and a PyTorch LSTM loaded
from the same canonical weights record the same tensors, θ_0 and ∇L(θ_0).
"""

from __future__ import annotations

import os

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

import traintape  # noqa: E402
from traintape.tf import GradientTape, from_canonical, to_canonical  # noqa: E402

T, IN, H, OUT, N = 5, 3, 4, 2, 6


def _keras_lstm() -> keras.Model:
    keras.utils.set_random_seed(0)
    inp = keras.Input((T, IN))
    h = keras.layers.LSTM(H, name="lstm")(inp)
    return keras.Model(inp, keras.layers.Dense(OUT, name="head")(h), name="lstm_model")


def _data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return (rng.normal(size=(N, T, IN)).astype(np.float32),
            rng.normal(size=(N, OUT)).astype(np.float32))  # fmt: skip


def _record_keras(url: str, m: keras.Model, steps: int = 2) -> None:
    x, y = (tf.constant(a) for a in _data())
    opt = keras.optimizers.SGD(0.1)
    with traintape.Recorder(url, traintape.CapturePolicy(full_every=1)) as rec:

        @tf.function
        def step() -> None:
            with GradientTape(rec, model=m, optimizer=opt) as tape:
                loss = tf.reduce_mean((m(x) - y) ** 2)
            g = tape.gradient(loss, m.trainable_variables)
            opt.apply_gradients(zip(g, m.trainable_variables, strict=True))

        for _ in range(steps):
            step()


def test_keras_lstm_records_bias_hh_pinned_at_zero(mem_url: str) -> None:
    m = _keras_lstm()
    b0 = np.random.default_rng(3).normal(size=4 * H).astype(np.float32)
    m.get_layer("lstm").cell.bias.assign(b0)
    _record_keras(mem_url, m)
    run = traintape.open_run(mem_url)
    assert traintape.validate(mem_url).ok
    names = run.tensor_names("param")
    assert {"lstm/bias_ih", "lstm/bias_hh"} <= set(names)
    assert names == run.tensor_names("grad") == run.tensor_names("update")
    spec = {s.name: s for s in run.manifest.specs("param")}["lstm/bias_hh"]
    assert spec.layer_kind == "lstm" and spec.shape == [4 * H] and spec.source_shape is None
    for t in (0, 1):
        np.testing.assert_array_equal(run.snapshot("lstm/bias_hh", "param", t), np.zeros(4 * H))
        np.testing.assert_array_equal(run.snapshot("lstm/bias_hh", "update", t), np.zeros(4 * H))
        g = run.snapshot("lstm/bias_ih", "grad", t)
        assert np.abs(g).max() > 0
        np.testing.assert_array_equal(run.snapshot("lstm/bias_hh", "grad", t), g)
    np.testing.assert_array_equal(run.snapshot("lstm/bias_ih", "param", 0), b0)
    # the whole SGD update lands in bias_ih (= the Keras bias)
    np.testing.assert_allclose(run.snapshot("lstm/bias_ih", "update", 0),
                               -0.1 * run.snapshot("lstm/bias_ih", "grad", 0), atol=1e-6)  # fmt: skip


def test_keras_and_torch_lstm_agree_at_step_0(mem_url: str) -> None:
    torch = pytest.importorskip("torch")
    import traintape.torch as ttorch

    class TorchLSTM(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lstm = torch.nn.LSTM(IN, H, batch_first=True)
            self.head = torch.nn.Linear(H, OUT)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seq, _ = self.lstm(x)
            return self.head(seq[:, -1])

    km = _keras_lstm()
    rng = np.random.default_rng(5)
    for v in km.trainable_variables:
        v.assign(rng.normal(scale=0.5, size=v.shape).astype(np.float32))
    canon = to_canonical(km)
    tm = TorchLSTM()
    ttorch.from_canonical(tm, canon)
    assert set(ttorch.to_canonical(tm)) == set(canon)
    # PyTorch weights with a non-zero bias_hh load into Keras as bias_ih + bias_hh
    tm.lstm.bias_hh_l0.data.normal_()
    from_canonical(km, ttorch.to_canonical(tm))
    x, y = _data()
    with torch.no_grad():
        ref = tm(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(km(x).numpy(), ref, rtol=1e-5, atol=1e-6)

    ttorch.from_canonical(tm, to_canonical(km))  # bias_hh = 0 again on both sides
    _record_keras(mem_url, km, steps=1)
    turl = mem_url + "-torch"
    opt = torch.optim.SGD(tm.parameters(), lr=0.1)
    rec = traintape.Recorder(turl, traintape.CapturePolicy(full_every=1))
    with rec, ttorch.watch(tm, rec, optimizer=opt, activations=False):
        opt.zero_grad()
        torch.mean((tm(torch.from_numpy(x)) - torch.from_numpy(y)) ** 2).backward()
        opt.step()
    ka, ta = traintape.open_run(mem_url), traintape.open_run(turl)
    for kind in ("param", "grad", "update"):
        assert ka.tensor_names(kind) == ta.tensor_names(kind)
    for n in ka.tensor_names("param"):
        np.testing.assert_array_equal(ka.snapshot(n, "param", 0), ta.snapshot(n, "param", 0))
        np.testing.assert_allclose(ka.snapshot(n, "grad", 0), ta.snapshot(n, "grad", 0),
                                   rtol=1e-4, atol=1e-6, err_msg=n)  # fmt: skip
