"""What ``grad``, ``update`` and the step mean in the TF tape adapter (DEFINITIONS, issue
24/26): ``grad`` before the optimizer's clipping with ``grad/clip_factor`` logged,
``update`` as applied in the storage dtype, counters from ``Recorder.next_step``, and
kinds asked explicitly recorded although the policy leaves them out. Compared with
TensorFlow's and Keras's own numbers.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")
if keras.backend.backend() != "tensorflow":  # pragma: no cover
    pytest.skip("Keras runs on another backend here", allow_module_level=True)

import traintape  # noqa: E402
from traintape.core.errors import RecordError  # noqa: E402
from traintape.tf import GradientTape, observe_optimizer  # noqa: E402

ALL = ("param", "grad", "update", "opt_state")


def _model(seed: int = 0) -> keras.Model:
    keras.utils.set_random_seed(seed)
    m = keras.Sequential([keras.Input((5,)), keras.layers.Dense(4, name="fc1"),
                          keras.layers.Dense(2, name="fc2")])  # fmt: skip
    return m


def _batch() -> tuple[np.ndarray, np.ndarray]:
    r = np.random.default_rng(3)
    return r.normal(size=(8, 5)).astype("float32"), r.normal(size=(8, 2)).astype("float32")


def _policy() -> traintape.CapturePolicy:
    return traintape.CapturePolicy(kinds=ALL, snapshot_kinds=ALL, full_every=1)


@pytest.mark.parametrize("clip", ["global_clipnorm", "clipnorm"])
def test_grad_is_raw_and_the_clip_factor_is_logged(mem_url: str, clip: str) -> None:
    m = _model()
    lr, c = 0.1, 0.05
    opt = keras.optimizers.SGD(lr, **{clip: c})
    x, y = _batch()
    rec = traintape.Recorder(mem_url, policy=_policy())
    theta0 = [v.numpy().copy() for v in m.trainable_variables]
    with tf.GradientTape() as plain:  # TensorFlow's own gradient at θ_0
        loss = tf.reduce_mean((m(x) - y) ** 2)
    want = [g.numpy() for g in plain.gradient(loss, m.trainable_variables)]
    with GradientTape(rec, model=m, optimizer=opt) as tape:
        loss = tf.reduce_mean((m(x) - y) ** 2)
    grads = tape.gradient(loss, m.trainable_variables)
    opt.apply_gradients(zip(grads, m.trainable_variables, strict=True))
    rec.close()
    run = traintape.open_run(mem_url)
    names = ["fc1/kernel", "fc1/bias", "fc2/kernel", "fc2/bias"]
    clipped = (
        [tf.clip_by_norm(g, c).numpy() for g in want]
        if clip == "clipnorm"
        else [g * min(1.0, c / np.sqrt(sum((a**2).sum() for a in want))) for g in want]
    )
    raw_norm = np.sqrt(sum((g.astype(np.float64) ** 2).sum() for g in want))
    clip_norm = np.sqrt(sum((g.astype(np.float64) ** 2).sum() for g in clipped))
    factor = float(run.metrics()["grad/clip_factor"].loc[0])
    assert factor == pytest.approx(clip_norm / raw_norm, rel=1e-5)
    assert factor < 0.9
    for n, g, gc, t0, v in zip(names, want, clipped, theta0, m.trainable_variables, strict=True):
        np.testing.assert_allclose(run.snapshot(n, "grad", 0), g, rtol=1e-6, atol=1e-7)
        # the update is what Keras applied: -lr * clipped gradient, as θ_1 − θ_0
        np.testing.assert_array_equal(run.snapshot(n, "update", 0), v.numpy() - t0)
        np.testing.assert_allclose(run.snapshot(n, "update", 0), -lr * gc, rtol=1e-4, atol=1e-8)


def test_no_clip_factor_without_clipping(mem_url: str) -> None:
    m = _model()
    opt = keras.optimizers.SGD(0.1)
    x, y = _batch()
    rec = traintape.Recorder(mem_url, policy=_policy())
    with GradientTape(rec, model=m, optimizer=opt) as tape:
        loss = tf.reduce_mean((m(x) - y) ** 2)
    opt.apply_gradients(
        zip(tape.gradient(loss, m.trainable_variables), m.trainable_variables, strict=True)
    )
    rec.close()
    assert "grad/clip_factor" not in traintape.open_run(mem_url).manifest.metrics


@pytest.mark.parametrize("compiled", [False, True])
def test_update_below_half_an_ulp_is_zero(mem_url: str, compiled: bool) -> None:
    m = _model()
    for v in m.trainable_variables:
        v.assign(tf.ones_like(v) * 3.0)
    opt = keras.optimizers.SGD(1e-12)  # |lr·g| << ulp(3)/2 = 2.4e-7
    x, y = _batch()
    rec = traintape.Recorder(mem_url, policy=_policy())

    def step() -> None:
        with GradientTape(rec, model=m, optimizer=opt) as tape:
            loss = tf.reduce_mean((m(x) - y) ** 2)
        opt.apply_gradients(
            zip(tape.gradient(loss, m.trainable_variables), m.trainable_variables, strict=True)
        )

    (tf.function(step) if compiled else step)()
    rec.close()
    run = traintape.open_run(mem_url)
    for n in ("fc1/kernel", "fc2/kernel"):
        assert np.abs(run.snapshot(n, "grad", 0)).min() > 1e-3
        np.testing.assert_array_equal(run.snapshot(n, "update", 0), 0.0)
    np.testing.assert_array_equal(m.trainable_variables[0].numpy(), 3.0)


def _tape_steps(rec: traintape.Recorder, m: keras.Model, n: int, **kw: object) -> None:
    x, y = _batch()
    for _ in range(n):
        with GradientTape(rec, model=m, **kw) as tape:
            loss = tf.reduce_mean((m(x) - y) ** 2)
        tape.gradient(loss, m.trainable_variables)


def test_counter_starts_at_the_recorders_next_step(run_dir: str) -> None:
    m = _model()
    with traintape.Recorder(run_dir) as rec:
        _tape_steps(rec, m, 3)
    with traintape.Recorder(run_dir, resume_step=3) as rec:
        _tape_steps(rec, m, 2)  # no step=, no optimizer: counts 3, 4
    assert list(traintape.open_run(run_dir).steps) == [0, 1, 2, 3, 4]


def test_fresh_optimizer_counts_from_next_step(run_dir: str) -> None:
    m = _model()
    x, y = _batch()
    with traintape.Recorder(run_dir) as rec:
        _tape_steps(rec, m, 2)
    with traintape.Recorder(run_dir, resume_step=2) as rec:
        opt = keras.optimizers.SGD(0.01)
        for _ in range(2):
            with GradientTape(rec, model=m, optimizer=opt) as tape:
                loss = tf.reduce_mean((m(x) - y) ** 2)
            g = tape.gradient(loss, m.trainable_variables)
            opt.apply_gradients(zip(g, m.trainable_variables, strict=True))
    run = traintape.open_run(run_dir)
    assert list(run.steps) == [0, 1, 2, 3]
    assert set(run.stats("update")["step"]) == {2, 3}


def test_explicit_step_that_disagrees_is_refused(run_dir: str) -> None:
    m = _model()
    with traintape.Recorder(run_dir) as rec:
        _tape_steps(rec, m, 3)
    with traintape.Recorder(run_dir, resume_step=3) as rec:
        with pytest.raises(RecordError, match=r"step=0 .*resumes at step 3"):
            _tape_steps(rec, m, 1, step=0)
        _tape_steps(rec, m, 1, step=3)
    assert list(traintape.open_run(run_dir).steps) == [0, 1, 2, 3]


def test_optimizer_that_disagrees_is_refused(run_dir: str) -> None:
    m = _model()
    with traintape.Recorder(run_dir) as rec:
        _tape_steps(rec, m, 2)
    opt = keras.optimizers.SGD(0.01)
    opt.build(m.trainable_variables)
    opt.iterations.assign(7)
    with (
        traintape.Recorder(run_dir, resume_step=2) as rec,
        pytest.raises(RecordError, match=r"iterations is 7 .*resumes at step 2"),
    ):
        observe_optimizer(opt, rec, model=m)


def test_explicit_kinds_win_over_the_default_policy(mem_url: str) -> None:
    m = _model()
    opt = keras.optimizers.Adam(0.01)
    x, y = _batch()
    rec = traintape.Recorder(mem_url)  # default policy: no opt_state
    assert not rec.policy.records_kind("opt_state")
    observe_optimizer(opt, rec, model=m, kinds=("update", "opt_state"))
    with GradientTape(rec, model=m, optimizer=opt) as tape:
        loss = tf.reduce_mean((m(x) - y) ** 2)
    opt.apply_gradients(
        zip(tape.gradient(loss, m.trainable_variables), m.trainable_variables, strict=True)
    )
    rec.close()
    run = traintape.open_run(mem_url)
    assert "fc1/kernel/mu" in run.tensor_names("opt_state")
    mu = opt._momentums[opt._get_variable_index(m.trainable_variables[0])].numpy()
    got = run.stats("opt_state").set_index("tensor").loc["fc1/kernel/mu"]
    assert got["l2"] == pytest.approx(float(np.sqrt((mu.astype(np.float64) ** 2).sum())), rel=1e-6)


def test_callback_restores_jit_compile_on_tensorflow(run_dir: str) -> None:
    import traintape.keras as ttk

    m = _model()
    m.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse", jit_compile=True)
    before = m.jit_compile  # Keras may itself refuse jit in some processes (seen once in CI)
    seen: list[bool] = []

    class Watch(keras.callbacks.Callback):
        def on_train_batch_end(self, batch: int, logs: object = None) -> None:
            seen.append(bool(self.model.jit_compile))

    x, y = _batch()
    with traintape.Recorder(run_dir) as rec:
        m.fit(x, y, batch_size=4, epochs=1, verbose=0, callbacks=[ttk.Callback(rec), Watch()])
    assert seen == [False, False]  # tf.numpy_function cannot be XLA-compiled
    assert m.jit_compile is before  # restored after fit (True where Keras allowed it)
    run = traintape.open_run(run_dir)
    assert list(run.steps) == [0, 1]
    version = run.manifest.producer.framework_version
    assert version.startswith(f"{keras.__version__} / tensorflow ")
