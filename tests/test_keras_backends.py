"""``traintape.keras.Callback`` on every Keras 3 backend (issue 26 item 3), run as a user
would: ``tests/_keras_child.py`` in a subprocess with ``KERAS_BACKEND`` set.

Checked against the framework's own numbers (the child saves them): weights and
optimizer momentum after ``fit``, the probe batch's layer outputs computed by Keras,
Keras's logged running-mean loss, ``model.jit_compile`` during ``fit``; and the
backends against each other (same initial weights and batches: same stats).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

keras = pytest.importorskip("keras")

import traintape  # noqa: E402

CHILD = Path(__file__).with_name("_keras_child.py")
ROOT = Path(__file__).resolve().parents[1]


def _available(backend: str) -> bool:
    mod = {"tensorflow": "tensorflow", "jax": "jax", "torch": "torch"}[backend]
    try:
        __import__(mod)
    except ImportError:
        return False
    return True


BACKENDS = [b for b in ("tensorflow", "jax", "torch") if _available(b)]


def run_child(out: Path, backend: str, mode: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "KERAS_BACKEND": backend,
        "PYTHONPATH": str(ROOT),
        "TF_CPP_MIN_LOG_LEVEL": "3",
        "JAX_PLATFORMS": "cpu",
        "CUDA_VISIBLE_DEVICES": "",
    }
    p = subprocess.run([sys.executable, str(CHILD), str(out), mode], env=env, capture_output=True,
                       text=True, timeout=600)  # fmt: skip
    assert p.returncode == 0, p.stderr[-4000:]
    if mode != "all":
        assert json.loads((out / "backend.json").read_text())["backend"] == backend


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Per backend, one child process running every mode (``OUT/<mode>``)."""
    root = tmp_path_factory.mktemp("keras")
    for b in BACKENDS:
        run_child(root / b, b, "all")
    return {b: root / b for b in BACKENDS}


@pytest.fixture(scope="module")
def fitted(runs: dict[str, Path]) -> dict[str, Path]:
    for d in runs.values():
        assert not (d / "fit" / "error.txt").exists(), (d / "fit" / "error.txt").read_text()
    return {b: d / "fit" for b, d in runs.items()}


def _mode(runs: dict[str, Path], backend: str, mode: str) -> Path:
    d = runs[backend] / mode
    assert not (d / "error.txt").exists(), (d / "error.txt").read_text()
    return d


N_STEPS = 8
NAMES = ["bn/bias", "bn/scale", "fc1/bias", "fc1/kernel", "head/bias", "head/kernel"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_fit_records_every_kind(fitted: dict[str, Path], backend: str) -> None:
    from _keras_child import CLIP, LR, MOMENTUM, initial

    out = fitted[backend]
    run = traintape.open_run(str(out / "store"))
    ref = np.load(out / "ref.npz")
    p = run.manifest.producer
    assert p.framework == "keras"
    assert p.framework_version.startswith(f"{keras.__version__} / {backend} ")
    assert list(run.steps) == list(range(N_STEPS))
    assert run.tensor_names("param") == sorted([*NAMES, "bn/running_mean", "bn/running_var"])
    assert run.tensor_names("grad") == NAMES == run.tensor_names("update")
    assert run.tensor_names("activation") == ["bn/output", "fc1/output", "head/output"]
    assert run.tensor_names("opt_state") == [f"{n}/trace" for n in NAMES]
    # θ_0 and BatchNorm statistics before batch 0: the loaded weights, exactly
    for n, a in initial().items():
        np.testing.assert_array_equal(run.snapshot(n, "param", 0), a, err_msg=n)
    # θ_T as Keras holds it = θ_{T-1} + update_{T-1} (update as applied)
    last = N_STEPS - 1
    for n in NAMES:
        got = run.snapshot(n, "param", last) + run.snapshot(n, "update", last)
        np.testing.assert_allclose(got, ref[f"final/{n}"], rtol=0, atol=1e-7, err_msg=n)
    # probe snapshots (step 0, θ_0, training=False) = Keras's own layer outputs
    for layer in ("fc1", "bn", "head"):
        np.testing.assert_allclose(run.snapshot(f"{layer}/output", "activation", 0),
                                   ref[f"probe0/{layer}/output"], rtol=1e-6, atol=1e-6)  # fmt: skip
    m = run.metrics()
    # batch_loss: Keras logs the running mean over the epoch's batches (4 per epoch)
    loss = ref["loss"]
    k = np.tile(np.arange(1, 5), 2)
    batch = np.where(k == 1, loss, k * loss - (k - 1) * np.roll(loss, 1))
    np.testing.assert_allclose(m["batch_loss"].to_numpy(), batch, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(m["loss"].to_numpy(), loss, rtol=1e-6)
    np.testing.assert_allclose(m["lr"].to_numpy(), LR, rtol=1e-6)
    # grad = the raw gradient; Keras's SGD: m ← μ·m − lr·f·g with f = min(1, c/‖g‖)
    # (global_clipnorm); θ += m. Keras's momentum after fit is the last recorded trace.
    clip = m["grad/clip_factor"].to_numpy()
    prev = {n: 0.0 for n in NAMES}
    for t in range(N_STEPS):
        g = {n: run.snapshot(n, "grad", t).astype(np.float64) for n in NAMES}
        norm = np.sqrt(sum((a**2).sum() for a in g.values()))
        assert clip[t] == pytest.approx(min(1.0, CLIP / norm), rel=1e-5)
        assert clip[t] < 1.0  # clipping is active in this run
        for n in NAMES:
            trace = run.snapshot(f"{n}/trace", "opt_state", t)
            np.testing.assert_allclose(trace, MOMENTUM * prev[n] - LR * clip[t] * g[n],
                                       rtol=1e-4, atol=1e-7, err_msg=f"{n} step {t}")  # fmt: skip
            np.testing.assert_allclose(run.snapshot(n, "update", t), trace, rtol=1e-5, atol=1e-7)
            prev[n] = trace
    for n in NAMES:
        path = {"fc1/kernel": "net/fc1/kernel", "fc1/bias": "net/fc1/bias",
                "bn/scale": "net/bn/gamma", "bn/bias": "net/bn/beta",
                "head/kernel": "net/head/kernel", "head/bias": "net/head/bias"}[n]  # fmt: skip
        key = next(k for k in ref.files if k.startswith("momentum/") and k.endswith(path[4:]))
        np.testing.assert_array_equal(prev[n], ref[key])


def test_jax_keeps_jit_compile_on(fitted: dict[str, Path]) -> None:
    if "jax" not in fitted:
        pytest.skip("jax not installed")
    ref = np.load(fitted["jax"] / "ref.npz")
    assert bool(ref["jit_before"]) and bool(ref["jit_after"])
    assert ref["jit"].all()  # seen by another callback at every batch of fit
    run = traintape.open_run(str(fitted["jax"] / "store"))
    assert run.manifest.producer.stats_backend in ("jax-ffi-c", "xla")


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "tensorflow"])
def test_backends_record_the_same_numbers(fitted: dict[str, Path], backend: str) -> None:
    if "tensorflow" not in fitted:
        pytest.skip("tensorflow not installed")
    a = traintape.open_run(str(fitted["tensorflow"] / "store"))
    b = traintape.open_run(str(fitted[backend] / "store"))
    for kind in ("param", "grad", "update", "activation", "opt_state"):
        assert a.tensor_names(kind) == b.tensor_names(kind), kind
        x, y = a.stats_array(kind), b.stats_array(kind)
        for j, stat in enumerate(a.manifest.stat_names):
            if stat in ("sig", "zero_frac"):  # scale-free stats of near-zero noise
                continue
            np.testing.assert_allclose(y[..., j], x[..., j], rtol=2e-4, atol=2e-6,
                                       err_msg=f"{kind} {stat}")  # fmt: skip
        for spec_a in a.manifest.specs(kind):
            spec_b = b.spec(spec_a.name, kind)
            assert (spec_b.shape, spec_b.dtype, spec_b.layer_kind) == (
                spec_a.shape, spec_a.dtype, spec_a.layer_kind), spec_a.name  # fmt: skip


@pytest.mark.parametrize("backend", BACKENDS)
def test_resume_counts_from_the_recorders_step(runs: dict[str, Path], backend: str) -> None:
    run = traintape.open_run(str(_mode(runs, backend, "resume") / "store"))
    assert list(run.steps) == [0, 1, 2, 3]
    assert run.manifest.commit.last_step == 3
    assert len(run.stats("grad")["step"].unique()) == 4


@pytest.mark.parametrize("backend", BACKENDS)
def test_resume_with_a_disagreeing_optimizer_is_refused(
    runs: dict[str, Path], backend: str
) -> None:
    err = (runs[backend] / "mismatch" / "error.txt").read_text()
    assert err.startswith("RecordError") and "iterations is 4" in err
    assert "resumes at step 2" in err


@pytest.mark.parametrize("backend", BACKENDS)
def test_update_below_half_an_ulp_is_zero(runs: dict[str, Path], backend: str) -> None:
    run = traintape.open_run(str(_mode(runs, backend, "tiny") / "store"))
    for n in ("fc1/kernel", "head/kernel"):
        assert np.abs(run.snapshot(n, "grad", 0)).max() > 1e-3
        np.testing.assert_array_equal(run.snapshot(n, "update", 0), 0.0)
    zf = run.stats("update").set_index(["step", "tensor"])["zero_frac"]
    assert zf.loc[(0, "fc1/kernel")] == 1.0


@pytest.mark.parametrize("backend", BACKENDS)
def test_explicit_kinds_win_over_the_policy(runs: dict[str, Path], backend: str) -> None:
    run = traintape.open_run(str(_mode(runs, backend, "explicit") / "store"))
    assert run.tensor_names("opt_state") == [f"{n}/trace" for n in NAMES]
    kinds = {k.value for k in run.kinds()}
    assert {"param", "grad", "opt_state"} <= kinds
    assert "update" not in kinds and "activation" not in kinds


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "tensorflow"])
def test_callback_imports_no_tensorflow_off_the_tf_backend(backend: str) -> None:
    code = (
        "import sys, traintape.keras\n"
        "from traintape.adapters.tf import keras_hooks, keras_" + backend + "\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'tensorflow'))\n"
    )
    env = {**os.environ, "KERAS_BACKEND": backend, "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=300, check=True)  # fmt: skip
    assert p.stdout.strip().splitlines()[-1] == "[]"
