"""Issue 25 item 7: every Recorder option is range-checked at construction, before
anything is claimed or written (``flush_every_steps=10**9`` aborted the interpreter at
the first commit; ``max_pending=0`` meant an unbounded queue; NaN seconds were taken)."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest

import traintape as tt


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("flush_every_steps", 10**9),
        ("flush_every_steps", 10**6),
        ("flush_every_steps", 0),
        ("flush_every_steps", True),
        ("flush_every_steps", 2.5),
        ("max_pending", 0),
        ("max_pending", -1),
        ("max_pending_bytes", 0),
        ("flush_every_seconds", math.nan),
        ("flush_every_seconds", math.inf),
        ("flush_every_seconds", 0),
        ("claim_stale_after", math.nan),
        ("write_timeout", -1.0),
        ("system_metrics", math.nan),
        ("compression", "lz4"),
        ("samples_per_step", 0),
    ],
)
def test_an_out_of_range_option_is_refused_naming_it(tmp_path, option: str, value: object) -> None:
    url = tmp_path / "run"
    with pytest.raises(ValueError, match=option):
        tt.Recorder(url, **{option: value})
    assert not os.path.exists(url)  # nothing written


def test_valid_options_are_taken(tmp_path) -> None:
    with tt.Recorder(tmp_path / "run", flush_every_steps=np.int64(8), flush_every_seconds=1,
                     max_pending=1, system_metrics=0.5, samples_per_step=32) as rec:  # fmt: skip
        rec.record(0, "param", {"w": np.ones(2, np.float32)})
    assert tt.open_run(tmp_path / "run").manifest.layout.row_chunk == 8
