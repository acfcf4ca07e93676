"""Record a Keras 3 ``model.fit`` with ``traintape.keras.Callback``.

    python examples/tf_keras_fit.py --out runs/keras_fit --epochs 2

Records param (incl. BatchNorm running statistics), grad, update, activation stats of
every parametrised layer, probe-batch activation snapshots every 20 steps, and the
``logs`` metrics.
"""

from __future__ import annotations

import argparse

import keras
import numpy as np

import traintape
import traintape.keras


def main(out: str, epochs: int) -> None:
    keras.utils.set_random_seed(0)
    L = keras.layers
    model = keras.Sequential(
        [keras.Input((8, 8, 1)), L.Conv2D(4, 3, name="conv"), L.BatchNormalization(name="bn"),
         L.ReLU(), L.Flatten(), L.Dense(10, name="head")]
    )  # fmt: skip
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile(optimizer="adam", loss=loss, metrics=["accuracy"])
    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 8, 8, 1)).astype(np.float32)
    y = rng.integers(0, 10, size=(256,))
    with traintape.Recorder(out, traintape.CapturePolicy(full_every=20)) as rec:
        cb = traintape.keras.Callback(rec, probe=x[:8])
        model.fit(x, y, batch_size=32, epochs=epochs, verbose=0, callbacks=[cb])
    run = traintape.open_run(out)
    print(f"{len(run.steps)} steps; param tensors: {run.tensor_names('param')}")
    print(f"activations: {run.tensor_names('activation')}")
    print(run.metrics().tail(3))


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", default="runs/keras_fit")
    p.add_argument("--epochs", type=int, default=2)
    a = p.parse_args()
    main(a.out, a.epochs)
