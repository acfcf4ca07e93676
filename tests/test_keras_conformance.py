"""Conformance columns ``keras-jax`` and ``keras-torch`` (issue 26 item 3).

The Keras conformance models (``conformance/models_tf.py``) run unchanged with
``KERAS_BACKEND=jax`` and ``torch`` (one worker subprocess per column, the backend set
before Keras is imported, as a user would) and must be identical, under the conformance
definition (``conformance/matrix.py``: every kind within tolerance at every step, θ_0
bit-exact), to the TensorFlow-backend column and to the torch column. Here: float32
SGD with momentum on ``mlp`` (tanh), ``cnn`` (BatchNormalization) and ``gru``, and
Adam on ``mlp``; the whole matrix is ``python -m conformance --frameworks torch tf
keras-jax keras-torch`` (README of conformance/).
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

pytest.importorskip("torch")
pytest.importorskip("jax")
pytest.importorskip("tensorflow")

from conformance.matrix import check_pair, produce
from conformance.worker import store_path

COLUMNS = ("torch", "tf", "keras-jax", "keras-torch")
MODELS = ("mlp", "cnn", "gru")
PAIRS = [p for p in itertools.combinations(COLUMNS, 2) if {"keras-jax", "keras-torch"} & set(p)]
CELLS = [(m, "float32", a, b) for m in MODELS for a, b in PAIRS]
CELLS += [("mlp", "float32+adam", a, b) for a, b in PAIRS]


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("keras-conformance")
    failed = produce(root, COLUMNS, ("float32",), MODELS)
    failed |= produce(root, COLUMNS, ("float32+adam",), ("mlp",))
    assert not failed, failed
    return root


@pytest.mark.parametrize(("model", "config", "a", "b"), CELLS, ids=["-".join(c) for c in CELLS])
def test_cell_identical(stores: Path, model: str, config: str, a: str, b: str) -> None:
    cell = check_pair(store_path(stores, a, model, config), store_path(stores, b, model, config),
                      model, config, names=(a, b))  # fmt: skip
    assert cell.identical, "\n".join(cell.problems)
    assert cell.initial_exact
    assert cell.max_abs is not None  # something was compared
