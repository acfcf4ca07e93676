"""The ``distributed`` column: the conformance models trained by several processes.

``python -m conformance.distributed [--models mlp transformer] [--out DIR]`` trains each
model (float32, SGD with momentum) in jobs of 2 processes on 127.0.0.1 — torch DDP and
torch FSDP2 (gloo), JAX + Flax Linen under ``jax.distributed`` (gloo CPU collectives,
2 devices per process, data-parallel over a mesh of all 4 devices) — every process
running the same code with the same store URL, and compares each store with the
single-process store of the same framework under the conformance definition of
identical (:func:`conformance.matrix.check_pair`). Exit 0 iff every cell is identical.

One process of a job: ``python -m conformance.distributed --worker RANK WORLD PORT
FRAMEWORK MODEL URL``.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

from conformance.matrix import Cell, check_pair

COLUMNS = {"torch-ddp": "torch", "torch-fsdp2": "torch", "jax-linen-2proc": "jax-linen"}
"""Distributed framework → the single-process framework it must equal."""
MODELS = ("mlp", "transformer")
CONFIG = "float32"
WORLD = 2


def _env(devices: int) -> dict[str, str]:
    root = str(Path(__file__).resolve().parent.parent)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    return env


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def worker(rank: int, world: int, port: int, framework: str, model: str, url: str) -> None:
    """One process of a job (or, with ``world`` 1, the single-process reference)."""
    if framework.startswith("torch"):
        from conformance import models_torch

        parallel = framework.split("-")[1] if world > 1 else None
        if parallel is not None:
            import torch.distributed as dist

            dist.init_process_group(
                "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
            )
        models_torch.train(model, url, CONFIG, parallel=parallel)
        if parallel is not None:
            dist.destroy_process_group()
        return
    import jax

    if world > 1:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            coordinator_address=f"127.0.0.1:{port}", num_processes=world, process_id=rank
        )
    from conformance import models_jax

    models_jax.train(model, url, CONFIG, "linen")


def run_job(framework: str, model: str, url: str, world: int = WORLD) -> str | None:
    """Run one job of ``world`` processes; None, or the failing process's output tail."""
    port = str(_port())
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "conformance.distributed",
                "--worker",
                str(r),
                str(world),
                port,
                framework,
                model,
                url,
            ],
            env=_env(2),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(world)
    ]
    failure = None
    try:
        for r, p in enumerate(procs):
            out, _ = p.communicate(timeout=600)
            if p.returncode != 0 and failure is None:
                failure = f"{framework} {model} process {r} exit {p.returncode}: {out[-1500:]}"
    finally:
        for p in procs:  # stop leftovers by PID
            if p.poll() is None:
                p.kill()
                p.wait()
    return failure


def run_column(root: str | Path, models: tuple[str, ...] = MODELS) -> list[Cell]:
    """Train every (distributed framework, model) job and its single-process reference
    under ``root``; one :class:`Cell` per pair."""
    root = Path(root)
    cells = []
    for model in models:
        refs: dict[str, Path] = {}
        for single in sorted(set(COLUMNS.values())):
            refs[single] = root / "single" / single / model
            fw = "torch-ddp" if single == "torch" else "jax-linen-2proc"
            err = run_job(fw, model, str(refs[single]), world=1)
            if err is not None:
                raise RuntimeError(err)
        for fw, single in COLUMNS.items():
            url = root / fw / model
            err = run_job(fw, model, str(url))
            if err is not None:
                cells.append(Cell(CONFIG, model, fw, single, identical=False,
                                  initial_exact=False, problems=[err]))  # fmt: skip
                continue
            cells.append(check_pair(url, refs[single], model, CONFIG, names=(fw, single)))
    return cells


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--worker":
        rank, world, port, framework, model, url = argv[1:7]
        worker(int(rank), int(world), int(port), framework, model, url)
        return 0
    p = argparse.ArgumentParser(prog="python -m conformance.distributed", description=__doc__)
    p.add_argument("--models", nargs="+", default=list(MODELS))
    p.add_argument("--out", default=None, help="keep the stores here (default: temp dir)")
    a = p.parse_args(argv)
    from rich.console import Console

    from conformance.matrix import render

    with tempfile.TemporaryDirectory(prefix="traintape-distributed-") as tmp:
        cells = run_column(a.out or tmp, tuple(a.models))
    Console(width=200).print(render(cells))
    return 0 if all(c.identical for c in cells) else 1


if __name__ == "__main__":
    sys.exit(main())
