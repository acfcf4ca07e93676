"""Cost of the torch adapter's pre-clip ``grad`` capture, in training-thread CPU time.

``traintape.torch.watch`` takes ``grad``'s statistics at the end of each backward pass
and, at the optimizer step, re-takes the gradient norms when the gradients changed since
(``traintape/adapters/torch/clip.py``). Variants, interleaved per round in one process
(same model and batch), ``--steps`` steps each, per-round medians:

- ``base``: forward + backward (+ ``clip_grad_norm_`` with ``--clip``) + Adam step;
- ``new``: the same under ``watch`` (``param`` and ``grad`` stats every step);
- ``at_step``: the same with the end-of-backward capture turned off, i.e. ``grad`` read
  from ``p.grad`` at the optimizer step as before the change (post-clip).

Prints the medians and the paired difference ``new − at_step`` (median, IQR). Thread
CPU time (``time.thread_time``) leaves out the store writer thread and the time the
training thread waits for a core, so the figure holds on a loaded machine.

Usage: python benchmarks/torch_grad_capture.py [--sizes 64,128,10] [--clip]
[--rounds 40] [--steps 10]
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time

import torch
from torch import nn

import traintape
import traintape.torch as tt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="64,128,10", help="MLP widths")
    ap.add_argument("--clip", action="store_true", help="clip_grad_norm_(1e-3) every step")
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--batch", type=int, default=32)
    a = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    sizes = [int(s) for s in a.sizes.split(",")]
    layers: list[nn.Module] = []
    for i, o in itertools.pairwise(sizes):
        layers += [nn.Linear(i, o), nn.ReLU()]
    model = nn.Sequential(*layers[:-1])
    opt = torch.optim.Adam(model.parameters(), 1e-4)
    x, y = torch.randn(a.batch, sizes[0]), torch.randint(0, sizes[-1], (a.batch,))
    params = list(model.parameters())
    n = sum(p.numel() for p in params)
    print(f"MLP {sizes} ({n / 1e6:.2f}M params), batch {a.batch}, clip {a.clip}, 1 thread")

    def step() -> None:
        opt.zero_grad(set_to_none=False)
        nn.functional.cross_entropy(model(x), y).backward()
        if a.clip:
            torch.nn.utils.clip_grad_norm_(params, 1e-3)
        opt.step()

    policy = traintape.CapturePolicy(every=1, kinds=("param", "grad"))
    rec = traintape.Recorder("memory://grad-capture", policy, flush_every_steps=10_000,
                             system_metrics=False)  # fmt: skip
    res: dict[str, list[float]] = {"base": [], "new": [], "at_step": []}
    done = [0]

    def timed() -> float:
        t0 = time.thread_time()
        step()
        return time.thread_time() - t0

    def run(name: str) -> None:
        if name == "base":
            ts = [timed() for _ in range(a.steps)]
        else:
            with tt.watch(model, rec, optimizer=opt, start_step=done[0], activations=False) as h:
                if name == "at_step":
                    h._bwd_queued = True  # never queue the end-of-backward capture
                ts = [timed() for _ in range(a.steps)]
                done[0] += a.steps
        res[name].append(statistics.median(ts) * 1e3)

    for _ in range(3):
        step()
    for r in range(a.rounds):
        for name in ("base", "new", "at_step") if r % 2 else ("at_step", "new", "base"):
            run(name)
    rec.close()
    med = {k: statistics.median(v) for k, v in res.items()}
    d = [p - q for p, q in zip(res["new"], res["at_step"], strict=True)]
    q1, _, q3 = statistics.quantiles(d, n=4)
    print("median ms/step (thread CPU time): " + ", ".join(f"{k} {v:.3f}" for k, v in med.items()))
    print(f"pre-clip grad capture, new - at_step paired: {statistics.median(d):+.3f} ms/step "
          f"[IQR {q1:+.3f}, {q3:+.3f}] = {100 * statistics.median(d) / med['base']:+.1f}% of "
          f"the plain step")  # fmt: skip


if __name__ == "__main__":
    main()
