"""Bad input is refused at the call with a RecordError naming it; capture stays enabled
and what was recorded before is kept (issue: reliability, "bad input refused at the call")."""

from __future__ import annotations

import numpy as np
import pytest

import traintape as tt
from traintape import RecordError
from traintape.schema import STAT_INDEX


def _ok(rec: tt.Recorder, step: int) -> None:
    rec.record(step, "grad", {"fc/kernel": np.full((2, 3), float(step), np.float32)})
    rec.log(step, loss=1.0 / (step + 1))


@pytest.mark.parametrize(
    ("step", "match"),
    [
        (3.5, r"step must be a non-negative integer.*3\.5.*float"),
        ("3", r"step must be a non-negative integer.*'3'.*str"),
        (True, r"step must be a non-negative integer.*True"),
        (-1, r"step must be between 0 and 2\*\*63 - 1, got -1"),
        (2**63, r"step must be between 0 and 2\*\*63 - 1"),
    ],
)
def test_bad_step_refused_at_the_call(mem_url: str, step: object, match: str) -> None:
    with tt.Recorder(mem_url) as rec:
        _ok(rec, 0)
        with pytest.raises(RecordError, match=match):
            rec.record(step, "grad", {"fc/kernel": np.zeros((2, 3), np.float32)})  # type: ignore[arg-type]
        with pytest.raises(RecordError, match=match):
            rec.log(step, loss=1.0)  # type: ignore[arg-type]
        assert rec.enabled
        _ok(rec, 1)
    run = tt.open_run(mem_url)
    assert run.steps.tolist() == [0, 1]


@pytest.mark.parametrize(
    "value",
    [
        np.zeros((2, 3), np.complex64),
        np.array(["2020-01-01"] * 6, dtype="datetime64[D]").reshape(2, 3),
        np.array([["a", "b", "c"]] * 2),
        np.array([[object()] * 3] * 2, dtype=object),
    ],
    ids=["complex64", "datetime64", "str", "object"],
)
def test_unsupported_dtype_names_the_tensor(mem_url: str, value: np.ndarray) -> None:
    with tt.Recorder(mem_url) as rec:
        _ok(rec, 0)
        with pytest.raises(RecordError, match=r"tensor 'fc/kernel' \(grad\) at step 1: dtype"):
            rec.record(1, "grad", {"fc/kernel": value})
        assert rec.enabled
        _ok(rec, 1)
    assert tt.open_run(mem_url).rows == 2


def test_overlong_name_segment_refused(mem_url: str) -> None:
    with tt.Recorder(mem_url) as rec:
        with pytest.raises(RecordError, match="characters long, more than 200"):
            rec.record(0, "grad", {"a" * 300 + "/kernel": np.zeros(2, np.float32)})
        assert rec.enabled
        _ok(rec, 0)
    assert tt.open_run(mem_url).rows == 1


@pytest.mark.parametrize("value", ["3", None, [1.0], {"a": 1}], ids=["str", "None", "list", "dict"])
def test_metric_value_must_be_a_number(mem_url: str, value: object) -> None:
    with tt.Recorder(mem_url) as rec:
        with pytest.raises(RecordError, match=r"metric 'loss' at step 0: value"):
            rec.log(0, loss=value)  # type: ignore[arg-type]
        rec.log(0, loss=np.float32(0.5), acc=np.array(1.0))  # numpy scalars are numbers
    m = tt.open_run(mem_url).metrics()
    assert m.loss.tolist() == [0.5] and m.acc.tolist() == [1.0]


def test_snapshot_shape_error_leaves_the_step_retryable(mem_url: str) -> None:
    """A refused snapshot (an activation's probe batch changed shape) leaves nothing of the
    call behind: the step's stats are not half-recorded and the corrected retry records."""
    pol = tt.CapturePolicy(full_every=1, kinds=("activation",), snapshot_kinds=("activation",))
    n = len(tt.STAT_NAMES)
    with tt.Recorder(mem_url, pol) as rec:
        rec.declare([tt.TensorSpec.build("fc/output", "activation", dtype="float32", shape=[8, 3])])
        good = np.ones((4, 3), np.float32)
        rec.record_stats(0, "activation", {"fc/output": np.zeros(n)}, snapshots={"fc/output": good})
        with pytest.raises(RecordError, match=r"snapshot shape \[5, 3\] differs"):
            rec.record_stats(1, "activation", {"fc/output": np.ones(n)},
                             snapshots={"fc/output": np.ones((5, 3), np.float32)})  # fmt: skip
        rec.record_stats(1, "activation", {"fc/output": np.full(n, 2.0)},
                         snapshots={"fc/output": good * 2})  # fmt: skip
    run = tt.open_run(mem_url)
    assert run.steps.tolist() == [0, 1]
    np.testing.assert_array_equal(run.snapshot("fc/output", "activation", 1), good * 2)
    assert run.stats_array("activation")[1, 0, STAT_INDEX["mean"]] == 2.0


def test_user_metadata_numpy_scalars_nan_and_bad_values(mem_url: str) -> None:
    import threading

    with tt.Recorder(mem_url, user={"lr": np.float32(0.5), "n": np.int64(3),
                                    "x": float("nan"), "sizes": np.arange(3)}) as rec:  # fmt: skip
        rec.record(0, "grad", {"fc/kernel": np.zeros((2, 3), np.float32)})
    user = tt.open_run(mem_url).manifest.user
    assert user == {"lr": 0.5, "n": 3, "x": "NaN", "sizes": [0, 1, 2]}
    threads = threading.active_count()
    with pytest.raises(RecordError, match=r"user\['f'\]: object is not a JSON value"):
        tt.Recorder(mem_url + "-2", user={"f": object()})
    assert threading.active_count() == threads  # no writer thread leaked


def test_manifest_copy_is_deep(mem_url: str) -> None:
    with tt.Recorder(mem_url) as rec:
        rec.record(0, "grad", {"fc/kernel": np.zeros((2, 3), np.float32)})
        m = rec.manifest
        m.tensors[0].shape[0] = 99
        m.user["x"] = 1
        rec.record(1, "grad", {"fc/kernel": np.zeros((2, 3), np.float32)})
    run = tt.open_run(mem_url)
    assert run.steps.tolist() == [0, 1] and run.spec("fc/kernel", "grad").shape == [2, 3]
    assert "x" not in run.manifest.user
