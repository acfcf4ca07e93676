"""TF/Keras adapter: optimizer slots recorded as ``opt_state`` under optax's field names
(the names the torch and JAX adapters give the same optimizers' state), in the
parameter's canonical layout, through the GradientTape path and the ``fit`` callback."""

from __future__ import annotations

import os

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

import traintape  # noqa: E402
import traintape.keras  # noqa: E402
from traintape import CapturePolicy, Kind  # noqa: E402
from traintape.tf import GradientTape  # noqa: E402

try:
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
except RuntimeError:  # already initialised by another test module
    pass

ALL = CapturePolicy(kinds=tuple(Kind), snapshot_kinds=tuple(Kind), full_every=1)
H = 3  # GRU units
STEPS = 4


def _model() -> keras.Model:
    inp = keras.Input((4, 2))
    h = keras.layers.GRU(H, reset_after=True, name="gru")(inp)
    return keras.Model(inp, keras.layers.Dense(2, name="head")(h), name="net")


def _data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(STEPS * 4, 4, 2)).astype(np.float32)
    y = rng.normal(size=(STEPS * 4, 2)).astype(np.float32)
    return x, y


# Keras gate blocks z, r, h -> canonical r, z, n along the last axis (written out here,
# independently of the adapter's transform)
_COLS = np.concatenate([np.arange(H, 2 * H), np.arange(0, H), np.arange(2 * H, 3 * H)])


def _canonical_slots(model: keras.Model, opt: keras.Optimizer) -> dict[str, np.ndarray]:
    """``<param>/<field>`` → Keras's own slot value, in canonical layout, read directly
    from the optimizer's slot lists."""
    cell = model.get_layer("gru").cell
    head = model.get_layer("head")
    params = {
        "gru/kernel_ih": (cell.kernel, lambda a: a[:, _COLS]),
        "gru/kernel_hh": (cell.recurrent_kernel, lambda a: a[:, _COLS]),
        "gru/bias_ih": (cell.bias, lambda a: a[0][_COLS]),
        "gru/bias_hh": (cell.bias, lambda a: a[1][_COLS]),
        "head/kernel": (head.kernel, lambda a: a),
        "head/bias": (head.bias, lambda a: a),
    }
    if isinstance(opt, keras.optimizers.SGD):
        lists = {"trace": opt.momentums}
    else:
        lists = {"mu": opt._momentums, "nu": opt._velocities}
    out = {}
    for name, (var, canon) in params.items():
        i = opt._get_variable_index(var)
        for field, slots in lists.items():
            out[f"{name}/{field}"] = canon(np.array(slots[i].numpy(), copy=True))
    return out


def _make_opt(kind: str) -> keras.Optimizer:
    if kind == "adam":
        return keras.optimizers.Adam(0.05)
    return keras.optimizers.SGD(0.1, momentum=0.9)


def _train_tape(url: str, kind: str, policy: CapturePolicy) -> list[dict[str, np.ndarray]]:
    """Two eager steps then two inside ``tf.function``; Keras's slots after each step."""
    keras.utils.set_random_seed(0)
    m, opt = _model(), _make_opt(kind)
    x, y = _data()
    rec = traintape.Recorder(url, policy)

    def step(xb: tf.Tensor, yb: tf.Tensor) -> None:
        with GradientTape(rec, model=m, optimizer=opt) as tape:
            loss = tf.reduce_mean((m(xb, training=True) - yb) ** 2)
        g = tape.gradient(loss, m.trainable_variables)
        opt.apply_gradients(zip(g, m.trainable_variables, strict=True))

    fstep = tf.function(step)
    seen = []
    for t in range(STEPS):
        (step if t < 2 else fstep)(
            tf.constant(x[4 * t : 4 * t + 4]), tf.constant(y[4 * t : 4 * t + 4])
        )
        seen.append(_canonical_slots(m, opt))
    rec.close()
    return seen


class _Slots(keras.callbacks.Callback):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[dict[str, np.ndarray]] = []

    def on_train_batch_end(self, batch: int, logs: object = None) -> None:
        self.seen.append(_canonical_slots(self.model, self.model.optimizer))


def _train_fit(url: str, kind: str, policy: CapturePolicy) -> list[dict[str, np.ndarray]]:
    keras.utils.set_random_seed(0)
    m = _model()
    m.compile(optimizer=_make_opt(kind), loss="mse")
    x, y = _data()
    slots = _Slots()
    with traintape.Recorder(url, policy) as rec:
        cb = traintape.keras.Callback(rec, metrics=False)
        m.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0, callbacks=[cb, slots])
    return slots.seen


TRAIN = {"tape": _train_tape, "fit": _train_fit}


@pytest.mark.parametrize(("kind", "stats"), [("adam", "host"), ("sgd", "host"), ("adam", "graph")])
@pytest.mark.parametrize("path", ["tape", "fit"])
def test_slots_recorded_named_and_equal_to_keras(
    mem_url: str, path: str, kind: str, stats: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``stats``: raw rows from the host fused kernel (on CPU) or TF's op graph."""
    from traintape.adapters.tf import stats as tf_stats

    monkeypatch.setattr(tf_stats, "_HOST", stats == "host" and tf_stats.host_stats_enabled())
    seen = TRAIN[path](mem_url, kind, ALL)
    run = traintape.open_run(mem_url)
    assert list(run.steps) == list(range(STEPS))
    params = run.tensor_names(Kind.UPDATE)
    fields = ("trace",) if kind == "sgd" else ("mu", "nu")
    names = run.tensor_names(Kind.OPT_STATE)
    assert names == sorted(f"{p}/{f}" for p in params for f in fields)
    assert sorted(seen[0]) == names
    for n in names:  # spec: the parameter's canonical shape; the parameter is the layer
        p, _, f = n.rpartition("/")
        spec = run.spec(n, Kind.OPT_STATE)
        assert spec.shape == run.spec(p, Kind.PARAM).shape == list(seen[0][n].shape)
        assert (spec.layer, spec.role, spec.layer_kind, spec.dtype) == (p, f, None, "float32")
    src = run.spec("gru/bias_hh/" + fields[0], Kind.OPT_STATE)
    assert src.source_name.endswith("[1]") and src.source_shape == [2, 3 * H]
    st = run.stats(Kind.OPT_STATE)
    for t in range(STEPS):
        for n in names:
            want = seen[t][n]
            assert np.any(want != 0), n  # state after step t, not the zeros before it
            np.testing.assert_array_equal(run.snapshot(n, Kind.OPT_STATE, t), want)
            row = st[(st.step == t) & (st.tensor == n)]
            np.testing.assert_allclose(row["l2"].to_numpy()[0], np.linalg.norm(want), rtol=1e-6)
            np.testing.assert_allclose(row["mean"].to_numpy()[0], want.mean(), rtol=1e-5,
                                       atol=1e-9)  # fmt: skip
    assert traintape.validate(mem_url).ok


@pytest.mark.parametrize("path", ["tape", "fit"])
def test_no_opt_state_unless_the_policy_records_it(mem_url: str, path: str) -> None:
    TRAIN[path](mem_url, "adam", CapturePolicy(full_every=2))  # default kinds: no opt_state
    run = traintape.open_run(mem_url)
    assert list(run.steps) == list(range(STEPS))
    assert run.tensor_names(Kind.UPDATE)
    assert run.tensor_names(Kind.OPT_STATE) == []
    assert not [s for s in run.manifest.tensors if s.kind == Kind.OPT_STATE]


def test_field_names_of_other_optimizers() -> None:
    from traintape.adapters.tf.names import model_entries
    from traintape.adapters.tf.opt_state import find_slots

    m = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, name="fc")])
    cases = {
        keras.optimizers.AdamW(amsgrad=True): ["mu", "nu", "nu_max"],
        keras.optimizers.RMSprop(momentum=0.5, centered=True): ["nu", "mu", "trace"],
        keras.optimizers.RMSprop(): ["nu"],
        keras.optimizers.SGD(): [],
        keras.optimizers.Adagrad(): ["sum_of_squares"],
        keras.optimizers.Adadelta(): ["e_g", "e_x"],
        keras.optimizers.Adamax(): ["mu", "nu"],
        keras.optimizers.Ftrl(): ["accumulators", "linears"],  # no optax equivalent
    }
    for opt, fields in cases.items():
        assert find_slots(opt, model_entries(m)) == []  # not built yet
        opt.build(m.trainable_variables)
        got = [s.name for s in find_slots(opt, model_entries(m))]
        assert got == [f"fc/{p}/{f}" for p in ("kernel", "bias") for f in fields], opt


def test_reshaped_and_pinned_parameters(mem_url: str) -> None:
    """Attention kernels (in, heads, head_dim) → (in, heads·head_dim): their slots too;
    the LSTM's pinned-zero ``bias_hh`` gets the Keras bias's slots (its gradient is the
    bias's, as the torch LSTM's ``bias_hh`` moments equal its ``bias_ih`` ones)."""
    inp = keras.Input((5, 6))
    h = keras.layers.LSTM(4, name="lstm", return_sequences=True)(inp)
    h = keras.layers.MultiHeadAttention(2, 3, name="mha")(h, h)
    m = keras.Model(inp, h)
    m.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8, 5, 6)).astype(np.float32)
    y = rng.normal(size=(8, 5, 4)).astype(np.float32)
    with traintape.Recorder(mem_url, ALL) as rec:
        cb = traintape.keras.Callback(rec, metrics=False)
        m.fit(x, y, batch_size=4, epochs=1, verbose=0, callbacks=[cb])
    run = traintape.open_run(mem_url)
    names = run.tensor_names(Kind.OPT_STATE)
    assert names == sorted(f"{p}/{f}" for p in run.tensor_names(Kind.UPDATE) for f in ("mu", "nu"))
    for n in names:
        assert run.spec(n, Kind.OPT_STATE).shape == run.spec(n.rpartition("/")[0], Kind.PARAM).shape
    opt = m.optimizer
    q = m.get_layer("mha").query_dense.kernel  # (4, 2, 3)
    nu = opt._velocities[opt._get_variable_index(q)].numpy()
    np.testing.assert_array_equal(run.snapshot("mha/q/kernel/nu", Kind.OPT_STATE, 1),
                                  nu.reshape(4, 6))  # fmt: skip
    assert run.spec("mha/q/kernel/nu", Kind.OPT_STATE).source_shape == [4, 2, 3]
    bias = m.get_layer("lstm").cell.bias
    mu = opt._momentums[opt._get_variable_index(bias)].numpy()
    assert np.any(mu != 0)
    for n in ("lstm/bias_ih/mu", "lstm/bias_hh/mu"):
        np.testing.assert_array_equal(run.snapshot(n, Kind.OPT_STATE, 1), mu)
