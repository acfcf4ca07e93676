"""torch DDP and FSDP2 (``fully_shard``) with 2 ranks on a gloo process group on
127.0.0.1: every rank runs the same code with the same store URL; the one store equals
the single-process store of the same model and global batch, and its gradient norm is
``clip_grad_norm_``'s total norm (not a shard's)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from _procs import free_port, run_all

import traintape
from traintape import Kind, open_run
from traintape.analysis import compare

SCRIPT = str(Path(__file__).with_name("_dist_torch.py"))
STEPS = 4
KINDS = (Kind.PARAM, Kind.GRAD, Kind.UPDATE, Kind.ACTIVATION, Kind.OPT_STATE)


def _job(world: int, url: str, mode: str, *extra: str) -> list[subprocess.CompletedProcess]:
    """Run ``world`` ranks to the end; leftovers are killed."""
    port = str(free_port())
    cmds = [[sys.executable, SCRIPT, str(r), str(world), port, url, mode, str(STEPS), *extra]
            for r in range(world)]  # fmt: skip
    return run_all(cmds)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> str:
    url = str(tmp_path_factory.mktemp("ref") / "one")
    r = _job(1, url, "single")[0]
    assert r.returncode == 0, r.stdout[-3000:]
    return url


@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_two_ranks_one_store_equal_to_single_process(tmp_path, reference, mode):
    url = str(tmp_path / mode)
    results = _job(2, url, mode)
    for r, res in enumerate(results):
        assert res.returncode == 0, f"rank {r}:\n{res.stdout[-3000:]}"
    assert "rank 0: done, wrote 4 rows" in results[0].stdout
    assert "rank 1: done, wrote 0 rows" in results[1].stdout
    assert traintape.validate(url).ok
    run, ref = open_run(url), open_run(reference)
    assert list(run.steps) == list(range(STEPS))
    for kind in KINDS:
        assert run.tensor_names(kind) == ref.tensor_names(kind), kind  # no wrapper prefixes
        np.testing.assert_allclose(
            run.stats_array(kind), ref.stats_array(kind), rtol=2e-5, atol=1e-6, err_msg=kind
        )
        if kind == Kind.ACTIVATION:
            continue  # no probe: activation snapshots are not taken
        for name in run.tensor_names(kind):  # whole tensors, assembled from the shards
            np.testing.assert_allclose(
                run.snapshot(name, kind, 2), ref.snapshot(name, kind, 2), rtol=2e-5, atol=1e-6
            )
    assert compare(url, reference, strict=True).identical
    if mode == "fsdp2":  # each rank wrote the block it holds: one shard per rank's block
        meta = json.loads(Path(url, "snapshots/param/0/kernel/zarr.json").read_text())
        assert meta["chunk_grid"]["configuration"]["chunk_shape"] == [1, 16, 16]
        shards = sorted(p.name for p in Path(url, "snapshots/param/0/kernel/c/0/0").iterdir())
        assert shards == ["0", "1"]
        progress = json.loads(Path(url, ".traintape/progress/1.json").read_text())
        assert progress["snapshots"]["param"] == 2  # rank 1 confirmed its blocks
    # the recorded global gradient norm is clip_grad_norm_'s (pre-clip) total norm, on
    # every rank, and grad/clip_factor the factor it applied (max norm 0.05)
    grad = run.stats_array(Kind.GRAD)[:, :, run.manifest.stat_names.index("l2")]
    total = np.sqrt((grad**2).sum(axis=1))
    for r in range(2):
        clip = json.loads(Path(f"{url}.clip{r}.json").read_text())
        np.testing.assert_allclose(total, clip, rtol=1e-5)
    factor = run.metrics()["grad/clip_factor"].to_numpy()
    want = np.minimum(1.0, 0.05 / (np.asarray(clip) + 1e-6))
    assert (want < 1).all()
    np.testing.assert_allclose(factor, want, rtol=1e-5)


def test_a_rank_killed_mid_run_leaves_a_valid_store(tmp_path):
    url = str(tmp_path / "killed")
    results = _job(2, url, "fsdp2", "2")  # rank 1 dies at step 2, after a flush
    assert results[1].returncode == 9, results[1].stdout[-2000:]
    rep = traintape.validate(url)
    assert rep.ok, rep
    run = open_run(url)
    assert list(run.steps) == [0, 1]
    assert np.isfinite(run.stats_array(Kind.GRAD)).all()


def test_fsdp1_is_refused_naming_what_is_supported(tmp_path):
    results = _job(2, str(tmp_path / "fsdp1"), "fsdp1")
    for res in results:
        assert res.returncode != 0
        assert "FullyShardedDataParallel (FSDP1) is not supported" in res.stdout, res.stdout[-2000:]
