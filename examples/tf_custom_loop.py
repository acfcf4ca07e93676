"""Record a TensorFlow custom training loop with ``traintape.tf.GradientTape``.

    python examples/tf_custom_loop.py --out runs/tf_custom --steps 50

Records param/grad (at ``tape.gradient``) and update (when the observed optimizer
applies the gradients) inside ``tf.function``; stat vectors every step, full tensors
every 10 steps.
"""

from __future__ import annotations

import argparse

import keras
import numpy as np
import tensorflow as tf

import traintape
import traintape.tf


def main(out: str, steps: int) -> None:
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((16,)), keras.layers.Dense(32, activation="relu", name="fc1"),
         keras.layers.Dense(1, name="fc2")]
    )  # fmt: skip
    opt = keras.optimizers.Adam(1e-2)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(512, 16)).astype(np.float32)
    y = (x[:, :1] * 2.0 - x[:, 1:2]).astype(np.float32)

    with traintape.Recorder(out, traintape.CapturePolicy(full_every=10)) as rec:

        @tf.function
        def train_step(xb: tf.Tensor, yb: tf.Tensor) -> tf.Tensor:
            with traintape.tf.GradientTape(rec, model=model, optimizer=opt) as tape:
                loss = tf.reduce_mean((model(xb, training=True) - yb) ** 2)
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))
            return loss

        for step in range(steps):
            i = (step * 64) % 512
            loss = train_step(x[i : i + 64], y[i : i + 64])
            rec.log(step, loss=float(loss))
    run = traintape.open_run(out)
    print(f"{len(run.steps)} steps, tensors {run.tensor_names('grad')}")
    print(run.metrics().tail(3))


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", default="runs/tf_custom")
    p.add_argument("--steps", type=int, default=50)
    a = p.parse_args()
    main(a.out, a.steps)
