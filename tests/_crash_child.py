"""Child process for crash tests: records deterministic data forever, resuming a store.

Usage: python _crash_child.py RUN_DIR FLUSH_EVERY [MODE]
Prints "ready <first step>" once the recorder is open, then records until killed
(MODE ``train``, the default), or records a few steps, prints "closing" and closes
(MODE ``close``: the parent kills it during ``close()``). A second writer on a live store
prints "refused <message>" and exits 3. Modes ``sustained`` (a full capture every step,
``max_pending`` 8) and ``slow`` (the same with every snapshot write delayed 20 ms:
storage slower than capture) record until killed; ``pidns`` is ``train`` with a claim
stale after 1 s (run as PID 1 of a new PID namespace by the parent). Every record prints
"step <n>" once the call returned, so the parent knows what was recorded at the kill.
Tensor values are a pure function of the step (see ``tensors``), so a parent can check
every committed value bit-exactly.
"""

from __future__ import annotations

import sys

import numpy as np

import traintape as tt

POLICY = tt.CapturePolicy(full_every=5, kinds=("param", "grad"), snapshot_kinds=("param",))
FULL = tt.CapturePolicy(full_every=1, kinds=("param", "grad"), snapshot_kinds=("param",))
SUSTAINED_PENDING = 8
"""``max_pending`` of the sustained and slow modes (the loss bound is computed from it)."""


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
    kw: dict = {}
    policy = POLICY
    if mode in ("sustained", "slow"):
        policy, kw = FULL, {"max_pending": SUSTAINED_PENDING}
    if mode == "slow":
        import time

        from traintape.core.writer import StoreWriter

        original = StoreWriter._write_snapshot

        def slow(self, snap):  # storage slower than capture
            time.sleep(0.02)
            original(self, snap)

        StoreWriter._write_snapshot = slow
    if mode == "pidns":
        kw["claim_stale_after"] = 1.0
    try:
        rec = tt.Recorder(url, policy, flush_every_steps=flush, flush_every_seconds=0.05, **kw)
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
        print(f"step {step}", flush=True)
        step += 1


if __name__ == "__main__":
    main()
