"""Memory-adaptive capture: full snapshots over the policy's memory budget are skipped
(never the stat rows, never the training), each skip an event naming step and kind."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import traintape as tt
from traintape.schema import CapturePolicy, EventType

SIZE = 64 * 1024  # float32 elements per snapshot: 256 KiB


def _run(url: Path, policy: CapturePolicy, steps: int = 6) -> tt.Recorder:
    # no commit before close: what was handed over stays pending (deterministic)
    rec = tt.Recorder(url, policy, flush_every_steps=1000, flush_every_seconds=1000.0)
    for t in range(steps):
        x = np.full(SIZE, float(t), np.float32)
        rec.record(t, "param", {"layer/kernel": x})
    rec.close()
    return rec


def test_over_budget_snapshots_are_skipped_with_an_event(tmp_path: Path) -> None:
    budget = int(2.5 * SIZE * 4)  # two pending snapshots fit, a third does not
    _run(tmp_path / "r", CapturePolicy(full_every=1, snapshot_budget_bytes=budget))
    run = tt.open_run(tmp_path / "r")
    assert run.steps.tolist() == [0, 1, 2, 3, 4, 5]  # every stats row is there
    np.testing.assert_array_equal(run.stats("param")["mean"].to_numpy(), np.arange(6.0))
    assert run.snapshot_steps("layer/kernel", "param").tolist() == [0, 1]
    np.testing.assert_array_equal(run.snapshot("layer/kernel", "param", 1), np.full(SIZE, 1.0))
    skipped = [e for e in run.events() if e.type == EventType.SNAPSHOT_SKIPPED]
    assert [(e.step, e.kind) for e in skipped] == [(t, "param") for t in range(2, 6)]
    assert skipped[0].data["bytes"] == SIZE * 4 and skipped[0].data["budget_bytes"] == budget
    assert "memory budget" in skipped[0].message


def test_no_budget_keeps_every_snapshot(tmp_path: Path) -> None:
    _run(tmp_path / "r", CapturePolicy(full_every=2))
    run = tt.open_run(tmp_path / "r")
    assert run.snapshot_steps("layer/kernel", "param").tolist() == [0, 2, 4]
    assert not [e for e in run.events() if e.type == EventType.SNAPSHOT_SKIPPED]


def test_fraction_of_available_memory(tmp_path: Path) -> None:
    _run(tmp_path / "r", CapturePolicy(full_every=1, snapshot_budget_fraction=1e-12))
    run = tt.open_run(tmp_path / "r")
    assert run.snapshot_steps("layer/kernel", "param").tolist() == []
    assert len([e for e in run.events() if e.type == EventType.SNAPSHOT_SKIPPED]) == 6


def test_adapters_ask_before_copying(tmp_path: Path) -> None:
    """The torch adapter asks Recorder.snapshots before it copies tensors to the host:
    over the budget nothing is copied, the event is there, grads are still recorded."""
    torch = pytest.importorskip("torch")
    import traintape.torch as ttt

    model = torch.nn.Linear(256, 256)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rec = tt.Recorder(
        tmp_path / "t",
        CapturePolicy(full_every=1, snapshot_budget_bytes=1024, kinds=("param", "grad")),
        system_metrics=False,
    )
    handle = ttt.watch(model, rec, optimizer=opt)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(4, 256)).sum().backward()
        opt.step()
    handle.remove()
    rec.close()
    run = tt.open_run(tmp_path / "t")
    assert run.steps.tolist() == [0, 1, 2]
    assert len(run.stats("grad")) == 3 * 2
    skipped = {(e.step, e.kind) for e in run.events() if e.type == EventType.SNAPSHOT_SKIPPED}
    assert skipped == {(t, k) for t in range(3) for k in ("param", "grad")}
    for name in ("kernel", "bias"):  # a bare Linear: the root layer
        assert run.snapshot_steps(name, "grad").tolist() == []


def test_budget_must_be_positive() -> None:
    with pytest.raises(ValueError, match="snapshot_budget_bytes"):
        CapturePolicy(snapshot_budget_bytes=0)
    with pytest.raises(ValueError, match="snapshot_budget_fraction"):
        CapturePolicy(snapshot_budget_fraction=1.5)
