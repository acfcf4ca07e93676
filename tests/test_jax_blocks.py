"""Holder-written JAX snapshots (traintape/adapters/jax/blocks.py), the host side: a
process joins its devices' slabs into one block at its global offset and hands the
snapshots over in step order, whatever order the device callbacks arrive in. (The
multi-process path end to end: tests/test_distributed_jax.py.)"""

from __future__ import annotations

import numpy as np
import pytest

from traintape.adapters.jax.blocks import Blocks, Devices, Split
from traintape.core.writer import Part
from traintape.schema import Kind


class _Rec:
    def __init__(self) -> None:
        self.got: list[tuple[int, Kind, dict[str, Part]]] = []

    def put_blocks(self, step: int, kind: Kind, blocks: dict[str, Part]) -> None:
        self.got.append((step, kind, blocks))


def _blocks(process: int = 1) -> tuple[Blocks, _Rec]:
    # 2 processes x 2 devices; tensor "w" (8, 3) spread along axis 0 (2 rows a device),
    # "b" (4,) along axis 0 (1 row a device)
    devs = Devices(mesh=None, local=2, process=process, processes=2)  # type: ignore[arg-type]
    splits = {
        0: Split((8, 3), "float32", 0, 2, devs),
        1: Split((4,), "float32", 0, 1, devs),
    }
    rec = _Rec()
    b = Blocks(rec, {0: Kind.GRAD, 1: Kind.GRAD}, {0: "w", 1: "b"}, splits, lambda f: f())  # type: ignore[arg-type]
    return b, rec


def test_a_process_block_is_its_devices_slabs_joined_at_its_offset():
    b, rec = _blocks(process=1)
    w = np.arange(24, dtype=np.float32).reshape(8, 3)
    bias = np.arange(4, dtype=np.float32)
    b.put(0, 5, np.array([6, 7]), w[6:8])  # second device first
    b.put(1, 5, np.array([2]), bias[2:3])
    assert rec.got == []  # not complete yet
    b.put(0, 5, np.array([4, 5]), w[4:6])
    b.put(1, 5, np.array([3]), bias[3:4])
    [(step, kind, parts)] = rec.got
    assert (step, kind) == (5, Kind.GRAD)
    np.testing.assert_array_equal(parts["w"].data, w[4:8])
    assert parts["w"].offset == (4, 0) and parts["w"].block == (4, 3) and parts["w"].holders
    np.testing.assert_array_equal(parts["b"].data, bias[2:4])
    assert parts["b"].offset == (2,) and parts["b"].shape == (4,)


def test_snapshots_are_handed_over_in_step_order():
    b, rec = _blocks(process=0)
    w = np.zeros((8, 3), np.float32)
    bias = np.zeros(4, np.float32)
    b.put(0, 0, np.array([0, 1]), w[0:2])  # step 0 waits for its last slab ...
    for step in (2,):  # ... while step 2 completes
        b.put(0, step, np.array([0, 1]), w[0:2])
        b.put(0, step, np.array([2, 3]), w[2:4])
        b.put(1, step, np.array([0]), bias[0:1])
        b.put(1, step, np.array([1]), bias[1:2])
    assert rec.got == []
    b.put(0, 0, np.array([2, 3]), w[2:4])
    b.put(1, 0, np.array([0]), bias[0:1])
    b.put(1, 0, np.array([1]), bias[1:2])
    assert [s for s, _, _ in rec.got] == [0, 2]


def test_a_slab_at_the_wrong_place_is_refused_naming_the_tensor():
    b, _ = _blocks(process=1)
    w = np.zeros((8, 3), np.float32)
    b.put(0, 3, np.array([0, 1]), w[0:2])  # rows of process 0, not this one
    with pytest.raises(RuntimeError, match=r"'w'.*expected"):
        b.put(0, 3, np.array([2, 3]), w[2:4])
