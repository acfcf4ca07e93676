"""Every kind means the same in every adapter (issue 24): the kind-semantics case of
conformance/semantics.py — torch AdamW + clip_grad_norm_ vs optax.chain(clip_by_global_norm,
adamw) under Flax Linen and NNX, same weights, clipping active and updates below half an
ulp — compares identical (strict), also with the ``traintape compare --strict`` CLI, and
each store records grad pre-clip and update as applied."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np

from conformance import semantics


def test_grad_and_update_mean_the_same_in_every_adapter(tmp_path) -> None:
    cells = semantics.run_case(tmp_path)
    assert {(c.a, c.b) for c in cells} == {
        ("torch", "jax-linen"), ("torch", "jax-nnx"), ("jax-linen", "jax-nnx")
    }  # fmt: skip
    for c in cells:
        assert c.identical, (c.a, c.b, c.problems, c.first_divergence)
    for f in semantics.FRAMEWORKS:
        assert semantics.check_store(semantics.store_path(tmp_path, f)) == []
    import traintape

    torch_run = traintape.open_run(semantics.store_path(tmp_path, "torch"))
    zf = torch_run.stats("update")["zero_frac"].to_numpy()
    assert (zf > 0).any() and (zf < 1).any()  # updates below and above half an ulp
    factor = torch_run.metrics()["grad/clip_factor"].to_numpy()
    assert (factor < 1).all() and np.isfinite(factor).all()  # clipping at every step
    cli = Path(sys.executable).with_name("traintape")
    res = subprocess.run(
        [str(cli), "compare", "--strict", str(semantics.store_path(tmp_path, "torch")),
         str(semantics.store_path(tmp_path, "jax-linen"))],
        capture_output=True, text=True,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]
