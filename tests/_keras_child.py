"""A user's Keras 3 script, run in a subprocess with KERAS_BACKEND set by the test.

``python tests/_keras_child.py OUT MODE`` (MODE ``all``: every mode into ``OUT/<mode>``): trains a small Dense → BatchNormalization →
ReLU → Dense model with ``fit`` and ``traintape.keras.Callback`` into ``OUT/store`` and
writes the framework's own numbers to ``OUT/ref.npz`` (weights and optimizer variables
after ``fit``, the probe batch's layer outputs at θ_0, Keras's logged ``loss`` after every
batch, ``model.jit_compile`` seen during ``fit``).

MODE ``fit``: SGD with momentum and ``global_clipnorm`` (clipping active), 2 epochs × 4
batches, every kind, full capture every step. MODE ``resume``: the same 2 steps twice,
the second ``fit`` with a fresh model, optimizer and ``Recorder(resume_step=2)``.
MODE ``mismatch``: a recorder resumed at step 2 with an optimizer at iterations 4.
MODE ``tiny``: SGD(lr=1e-12): every update is below half an ulp of its parameter.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import keras
import numpy as np

import traintape
import traintape.keras as ttk

N_IN, N_H, N_OUT, B, NB = 6, 8, 3, 8, 4
LR, MOMENTUM, CLIP = 0.1, 0.9, 0.5


def build() -> keras.Model:
    x = keras.Input((N_IN,))
    h = keras.layers.Dense(N_H, name="fc1")(x)
    h = keras.layers.BatchNormalization(momentum=0.9, name="bn")(h)
    h = keras.layers.ReLU(name="relu")(h)
    return keras.Model(x, keras.layers.Dense(N_OUT, name="head")(h), name="net")


def initial() -> dict[str, np.ndarray]:
    r = np.random.default_rng(0)
    return {
        "fc1/kernel": r.normal(0, 0.5, (N_IN, N_H)).astype("float32"),
        "fc1/bias": r.normal(0, 0.1, (N_H,)).astype("float32"),
        "bn/scale": (1 + r.normal(0, 0.1, (N_H,))).astype("float32"),
        "bn/bias": r.normal(0, 0.1, (N_H,)).astype("float32"),
        "bn/running_mean": np.zeros(N_H, "float32"),
        "bn/running_var": np.ones(N_H, "float32"),
        "head/kernel": r.normal(0, 0.5, (N_H, N_OUT)).astype("float32"),
        "head/bias": np.zeros(N_OUT, "float32"),
    }


def data() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    r = np.random.default_rng(1)
    x = r.normal(size=(NB * B, N_IN)).astype("float32")
    y = r.normal(size=(NB * B, N_OUT)).astype("float32")
    return x, y, x[:5]


class Watch(keras.callbacks.Callback):
    """Keras's logged running-mean loss after each batch, and jit_compile during fit."""

    def __init__(self) -> None:
        super().__init__()
        self.loss: list[float] = []
        self.jit: list[bool] = []

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self.loss.append(float(np.asarray((logs or {})["loss"])))
        self.jit.append(bool(self._model.jit_compile))


def fit(model: keras.Model, rec: traintape.Recorder, epochs: int, nb: int, **kw: object) -> Watch:
    x, y, probe = data()
    w = Watch()
    model.fit(x[: nb * B], y[: nb * B], batch_size=B, epochs=epochs, shuffle=False, verbose=0,
              callbacks=[ttk.Callback(rec, probe=probe, **kw), w])  # fmt: skip
    return w


def compiled(lr: float = LR, clip: float | None = CLIP) -> keras.Model:
    model = build()
    ttk.from_canonical(model, initial())
    opt = keras.optimizers.SGD(lr, momentum=MOMENTUM, global_clipnorm=clip)
    model.compile(optimizer=opt, loss="mse")
    return model


def main(out: Path, mode: str) -> None:
    url = str(out / "store")
    kinds = ("param", "grad", "update", "activation", "opt_state")
    policy = traintape.CapturePolicy(kinds=kinds, snapshot_kinds=kinds, full_every=1)
    ref: dict[str, object] = {}
    if mode == "fit":
        model = compiled()
        _, _, probe = data()
        for name in ("fc1", "bn", "head"):  # the probe's layer outputs at θ_0 (inference)
            sub = keras.Model(model.inputs, model.get_layer(name).output)
            ref[f"probe0/{name}/output"] = keras.ops.convert_to_numpy(sub(probe, training=False))
        jit_before = bool(model.jit_compile)
        with traintape.Recorder(url, policy=policy) as rec:
            w = fit(model, rec, epochs=2, nb=NB)
        for n, a in ttk.to_canonical(model).items():
            ref[f"final/{n}"] = a
        opt = model.optimizer
        for v in opt._trainable_variables:
            m = opt.momentums[opt._get_variable_index(v)]
            ref[f"momentum/{v.path}"] = keras.ops.convert_to_numpy(m)
        ref["loss"] = np.asarray(w.loss)
        ref["jit"] = np.asarray(w.jit)
        ref["jit_before"] = np.asarray(jit_before)
        ref["jit_after"] = np.asarray(bool(model.jit_compile))
    elif mode == "resume":
        with traintape.Recorder(url, policy=policy) as rec:
            fit(compiled(), rec, epochs=1, nb=2)
        with traintape.Recorder(url, resume_step=2) as rec:
            fit(compiled(), rec, epochs=1, nb=2)
    elif mode == "mismatch":
        with traintape.Recorder(url, policy=policy) as rec:
            fit(compiled(), rec, epochs=1, nb=2)
        model = compiled()
        model.optimizer.build(model.trainable_variables)
        model.optimizer.iterations.assign(4)  # restored from another step's checkpoint
        with traintape.Recorder(url, resume_step=2) as rec:
            fit(model, rec, epochs=1, nb=1)  # iterations 4 != next step 2: refused
    elif mode == "tiny":
        with traintape.Recorder(url, policy=policy) as rec:
            fit(compiled(lr=1e-12, clip=None), rec, epochs=1, nb=2)
    elif mode == "explicit":  # default policy (no opt_state) + kinds asked explicitly
        with traintape.Recorder(url) as rec:
            fit(compiled(), rec, epochs=1, nb=2, kinds=("param", "grad", "opt_state"))
    else:
        raise KeyError(mode)
    np.savez(out / "ref.npz", **ref)
    (out / "backend.json").write_text(json.dumps({"backend": keras.backend.backend()}))


MODES = ("fit", "resume", "mismatch", "tiny", "explicit")


def run_all(out: Path) -> None:
    """Every mode into ``OUT/<mode>`` (one process: Keras is imported once); a mode's
    exception is written to ``OUT/<mode>/error.txt``."""
    for mode in MODES:
        d = out / mode
        d.mkdir(parents=True, exist_ok=True)
        try:
            main(d, mode)
        except Exception as e:
            (d / "error.txt").write_text(f"{type(e).__name__}: {e}")


if __name__ == "__main__":
    if sys.argv[2] == "all":
        run_all(Path(sys.argv[1]))
    else:
        main(Path(sys.argv[1]), sys.argv[2])
