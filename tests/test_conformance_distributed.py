"""The conformance suite's ``distributed`` column: MLP and transformer block trained by
2-process jobs (torch DDP, torch FSDP2, JAX Linen under jax.distributed) are identical to
the single-process cells (conformance/distributed.py; ~40 s on 2 cores)."""

from __future__ import annotations

from conformance.distributed import COLUMNS, MODELS, run_column


def test_distributed_column_identical_to_single_process(tmp_path):
    cells = run_column(tmp_path)
    assert {(c.model, c.a) for c in cells} == {(m, f) for m in MODELS for f in COLUMNS}
    bad = [f"{c.model} {c.a}↔{c.b}: {c.problems}" for c in cells if not c.identical]
    assert not bad, bad
    assert all(c.initial_exact for c in cells)
    # the two stores of a cell are different runs: something was compared, not nothing
    assert all(c.max_abs is not None for c in cells)
