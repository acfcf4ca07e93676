"""tf.distribute with several replicas is refused with a clear error before training
(the TF adapter does not merge per-replica statistics); one replica still records."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import sys, numpy as np
    import tensorflow as tf
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    import keras, traintape, traintape.keras, traintape.tf
    keras.utils.set_random_seed(0)
    url, replicas, how = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    devices = ["/cpu:0", "/cpu:1"][:replicas]
    strategy = tf.distribute.MirroredStrategy(devices)
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, name="l0")])
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    x = np.ones((8, 4), "float32"); y = np.zeros((8, 3), "float32")
    with traintape.Recorder(url) as rec:
        if how == "fit":
            model.fit(x, y, batch_size=4, epochs=1, verbose=0,
                      callbacks=[traintape.keras.Callback(rec)])
        else:
            def step():
                with traintape.tf.GradientTape(rec, model=model) as tape:
                    loss = tf.reduce_mean(model(x) ** 2)
                return tape.gradient(loss, model.trainable_variables)
            strategy.run(step)
    print("recorded", traintape.open_run(url).rows)
    """
)


def _run(tmp_path, replicas: int, how: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    return subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path / f"{how}{replicas}"), str(replicas), how],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip


@pytest.mark.parametrize("how", ["fit", "tape"])
def test_two_replicas_refused_with_the_strategy_named(tmp_path, how):
    r = _run(tmp_path, 2, how)
    assert r.returncode != 0
    assert "MirroredStrategy with 2 replicas in sync is not supported" in r.stderr, r.stderr[-2000:]


def test_one_replica_records(tmp_path):
    r = _run(tmp_path, 1, "fit")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "recorded 2" in r.stdout
