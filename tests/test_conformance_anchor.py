"""The conformance matrix's anchor outside traintape (issue 29): one framework's recorded
stats against float64 numpy of its own tensors, a probe with NaN/Inf/zeros planted in
them, and the refusal of a matrix with zero cells.

A store of the torch MLP is written by the conformance worker (its own subprocess, as in
the matrix). With a shared statistic planted wrong (``std`` with n-1, ``nan_count``
forced to 0: ``benchmarks/mutation_check.py``) these fail while every framework would
still agree with every other.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from conformance.anchor import (  # noqa: E402
    anchor_problems,
    mismatches,
    planted_probe,
    recorded_vs_snapshots,
)
from conformance.matrix import require_cells  # noqa: E402

ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


@pytest.fixture(scope="module")
def torch_mlp(tmp_path_factory):
    pytest.importorskip("torch")
    import traintape
    from conformance.worker import store_path

    root = tmp_path_factory.mktemp("anchor")
    p = subprocess.run(
        [sys.executable, "-m", "conformance.worker", "torch", "float32", str(root), "mlp"],
        env=ENV,
        capture_output=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stdout.decode()[-2000:] + p.stderr.decode()[-2000:]
    return traintape.open_run(str(store_path(root, "torch", "mlp", "float32")))


def test_recorded_stats_match_float64_numpy_of_the_snapshots(torch_mlp):
    assert recorded_vs_snapshots(torch_mlp, "torch") == []
    assert anchor_problems(torch_mlp, "torch") == []


def test_planted_nan_inf_zero_probe(torch_mlp):
    assert planted_probe(torch_mlp, "torch") == []


def test_anchor_names_a_wrong_statistic():
    rng = np.random.default_rng(0)
    x = rng.normal(size=16).astype(np.float32)
    names = ["mean", "std", "nan_count"]
    v = x.astype(np.float64)
    good = [v.mean(), v.std(), 0.0]
    assert mismatches(good, names, x) == []
    sample_std = [v.mean(), v.std(ddof=1), 0.0]
    assert [m.split(":")[0] for m in mismatches(sample_std, names, x)] == ["std"]
    y = x.copy()
    y[3] = np.nan
    assert [m.split(":")[0] for m in mismatches(good, names, y)] == ["mean", "std", "nan_count"]


def test_zero_cells_refused():
    with pytest.raises(ValueError, match="zero cells"):
        require_cells([], ("torch",))
    p = subprocess.run(
        [sys.executable, "-m", "conformance", "--frameworks", "torch"],
        env=ENV,
        capture_output=True,
        timeout=120,
    )
    assert p.returncode != 0
    assert "zero cells" in p.stderr.decode()


def test_cell_of_a_store_with_itself_is_identical_and_anchored(torch_mlp):
    """A matrix cell (check_pair) of a store against itself: compare alone cannot fail,
    so any problem here comes from the anchor — with a shared statistic planted wrong
    (std with n-1, nan_count forced to 0) this cell, like every cell, differs."""
    from conformance.matrix import check_pair

    url = torch_mlp.url
    cell = check_pair(url, url, "mlp", "float32", names=("torch", "torch"))
    assert cell.problems == [] and cell.identical
