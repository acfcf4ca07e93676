"""Child process for crash tests: records deterministic data forever, resuming a store.

Usage: python _crash_child.py RUN_DIR FLUSH_EVERY [MODE]
Prints "ready <first step>" once the recorder is open, then records until killed
(MODE ``train``, the default), or records a few steps, prints "closing" and closes
(MODE ``close``: the parent kills it during ``close()``). A second writer on a live store
prints "refused <message>" and exits 3.
Tensor values are a pure function of the step (see ``tensors``), so a parent can check
every committed value bit-exactly.
"""

from __future__ import annotations

import sys

import numpy as np

import traintape as tt

POLICY = tt.CapturePolicy(full_every=5, kinds=("param", "grad"), snapshot_kinds=("param",))


def tensors(step: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(step)
    return {
        "block/0/dense/kernel": rng.normal(size=(64, 64)).astype(np.float32),
        "block/0/dense/bias": rng.normal(size=64).astype(np.float32),
        "block/1/dense/kernel": rng.normal(size=(64, 32)).astype(np.float32),
        "head/embedding": rng.normal(size=(100, 32)).astype(np.float32),
    }


def record(rec: tt.Recorder, step: int) -> None:
    t = tensors(step)
    rec.record(step, "param", t)
    rec.record(step, "grad", {k: v * 0.5 for k, v in t.items()})
    rec.log(step, loss=float(step))


def main() -> None:
    url, flush = sys.argv[1], int(sys.argv[2])
    mode = sys.argv[3] if len(sys.argv) > 3 else "train"
    try:
        rec = tt.Recorder(url, POLICY, flush_every_steps=flush, flush_every_seconds=0.05)
    except tt.StoreError as e:
        print(f"refused {e}", flush=True)
        sys.exit(3)
    last = rec.manifest.commit.last_step
    step = 0 if last is None else last + 1
    print(f"ready {step}", flush=True)
    if mode == "close":
        for s in range(step, step + 7):
            record(rec, s)
        print("closing", flush=True)
        rec.close()
        print("closed", flush=True)
        return
    while True:
        record(rec, step)
        step += 1


if __name__ == "__main__":
    main()
