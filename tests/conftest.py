from __future__ import annotations

import itertools
import os

import pytest

_counter = itertools.count()


@pytest.fixture
def mem_url() -> str:
    """A fresh memory:// store URL (shared process-wide TensorStore context)."""
    return f"memory://test-{os.getpid()}-{next(_counter)}"


@pytest.fixture
def run_dir(tmp_path) -> str:
    return str(tmp_path / "run")
