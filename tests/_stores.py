"""Stores of tiny real JAX trainings with known defects, built once per test process.

(The cache lives here rather than in a conftest fixture so that every analysis test
module shares one set of stores.)
"""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import tempfile

import pytest
from _training import train_mlp

NAN_STEP = 7
NAN_TENSOR = "layers/1/kernel"

CASES: dict[str, dict] = {
    # 9 sigmoid layers: gradients shrink ~4x per layer towards the input
    "sigmoid_deep": dict(sizes=[16, *[32] * 8, 4], act="sigmoid", steps=30, lr=0.5),
    "healthy": dict(sizes=[16, 32, 32, 4], act="tanh", steps=40, lr=0.1, full_every=10),
    # learning rate far too high for inputs of scale 5: the run diverges
    "exploding": dict(sizes=[16, 32, 32, 4], act="relu", steps=30, lr=0.3, input_scale=5.0),
    # layer 1 has bias -20: its ReLU never fires
    "dead": dict(sizes=[16, 32, 32, 4], act="relu", steps=30, lr=0.05, bias_init={1: -20.0},
                 full_every=10),
    "nan": dict(sizes=[16, 32, 32, 4], act="relu", steps=30, lr=0.05,
                nan_at=(NAN_STEP, NAN_TENSOR)),
}  # fmt: skip


@functools.cache
def build(name: str) -> str:
    """Train case ``name`` once per process; returns its store path."""
    root = _root()
    path = os.path.join(root, name)
    train_mlp(path, **CASES[name])
    return path


@functools.cache
def _root() -> str:
    root = tempfile.mkdtemp(prefix="traintape-trained-")
    atexit.register(shutil.rmtree, root, True)
    return root


@pytest.fixture
def stores():
    """Lazy mapping: ``stores[name]`` trains that case on first use."""

    class _Lazy:
        def __getitem__(self, name: str) -> str:
            return build(name)

    return _Lazy()
