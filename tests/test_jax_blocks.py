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
    devs = Devices(order=(), local=2, process=process, processes=2)
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
    b.put(0, 5, 3, w[6:8])  # device 3 (process 1's second) first
    b.put(1, 5, 2, bias[2:3])
    assert rec.got == []  # not complete yet
    b.put(0, 5, 2, w[4:6])
    b.put(1, 5, 3, bias[3:4])
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
    b.put(0, 0, 0, w[0:2])  # step 0 waits for its last slab ...
    b.put(0, 2, 0, w[0:2])  # ... while step 2 completes
    b.put(0, 2, 1, w[2:4])
    b.put(1, 2, 0, bias[0:1])
    b.put(1, 2, 1, bias[1:2])
    assert rec.got == []
    b.put(0, 0, 1, w[2:4])
    b.put(1, 0, 0, bias[0:1])
    b.put(1, 0, 1, bias[1:2])
    assert [s for s, _, _ in rec.got] == [0, 2]


def test_a_slab_at_the_wrong_place_is_refused_naming_the_tensor():
    b, rec = _blocks(process=1)
    w = np.zeros((8, 3), np.float32)
    with pytest.raises(RuntimeError, match=r"'w' from device 1, expected devices 2..3"):
        b.put(0, 3, 1, w[2:4])  # a device of process 0, not this one
    assert rec.got == []


SPREAD_STATS = """
import numpy as np, jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from traintape.adapters.jax import stats as S
from traintape.adapters.jax.blocks import split_for
from traintape.schema.stats import index_map, reference_raw_rows
assert S.stats_mode() == "kernel"
mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "model"))
rng = np.random.default_rng(0)
w = rng.normal(size=(8, 12)).astype(np.float32)  # spread along axis 0
v = rng.normal(size=(6, 16)).astype(np.float32)  # held transposed: canonical (16, 6)
b = rng.normal(size=(3,)).astype(np.float32)  # no axis 4 divides: reduced whole
tmap = index_map((6, 16), (1, 0))
args = [jax.device_put(w, NamedSharding(mesh, P(None, "model"))),
        jax.device_put(v, NamedSharding(mesh, P("data", None))),
        jax.device_put(b, NamedSharding(mesh, P()))]
seen, decoders = [], []
@jax.jit
def f(w, v, b):
    seen.append([split_for(a, holders=False) is not None for a in (w, v, b)])
    payload, decode = S.device_stats([w, v, b], [None, tmap, None])
    decoders.append(decode)
    return payload
payload = jax.device_get(f(*args))
got = decoders[0](payload)
want = reference_raw_rows([w, v, b], [None, tmap, None])
assert seen == [[True, True, False]], seen
np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
print("ok")
"""


def test_stats_of_arrays_spread_over_devices_are_the_whole_arrays():
    """Over several devices the FFI kernel reduces one slab per device (a custom call's
    operands would be gathered whole onto every device): the merged rows, sig included
    (each slab's index map moved to where it starts), equal the numpy reference."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}  # fmt: skip
    r = subprocess.run([sys.executable, "-c", SPREAD_STATS], env=env, capture_output=True,
                       text=True, timeout=300)  # fmt: skip
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]
