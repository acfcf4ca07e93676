"""Overhead of traintape.torch.watch stats on a >= 10M-parameter MLP (CPU, 2 threads).

Variants, interleaved round-robin in one process (same model, same batch, medians):

- ``baseline``: forward + backward + Adam step;
- ``traintape``: the same step under ``traintape.torch.watch`` recording ``param`` and
  ``grad`` stat vectors every step (``CapturePolicy(every=1, kinds=(param, grad))``,
  in-memory store);
- ``floor``: baseline step followed by one plain ``sum`` over the same params + grads
  (one memory pass: the floor for stats capture), timed on its own in the same loop;
- ``wandb``: ``wandb.watch(model, log="all", log_freq=1)`` + ``wandb.log`` per step,
  ``WANDB_MODE=offline``;
- ``tensorboard``: ``SummaryWriter.add_histogram`` for every parameter and gradient
  every step.

Prints ms/step medians, traintape overhead / floor (from step times and from the stats
call timed directly) and overhead as % of the step, and the peers' step-time ratios.
Usage: python benchmarks/torch_overhead.py [--batch 512] [--rounds 5] [--steps 3] [--quick]
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import tempfile
import time
from collections.abc import Callable

import torch
from torch import nn

import traintape
import traintape.torch as tt
from traintape.adapters.torch import stats as S


def make_model(sizes: list[int]) -> nn.Sequential:
    layers: list[nn.Module] = []
    for a, b in itertools.pairwise(sizes):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3, help="steps per variant per round")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="tiny smoke run")
    ap.add_argument("--no-peers", action="store_true", help="skip wandb / tensorboard")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    sizes = [1024, 2048, 2048, 2048, 1024, 10]
    if args.quick:
        sizes, args.batch, args.rounds, args.steps = [64, 128, 10], 32, 2, 2
    model = make_model(sizes)
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    x = torch.randn(args.batch, sizes[0])
    y = torch.randint(0, sizes[-1], (args.batch,))
    loss_fn = nn.CrossEntropyLoss()
    params = list(model.parameters())
    print(f"model: MLP {sizes}, {n_params / 1e6:.2f}M params, batch {args.batch}, "
          f"{args.threads} threads, torch {torch.__version__}")  # fmt: skip

    def step() -> float:
        opt.zero_grad(set_to_none=False)
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        return float(loss.detach())

    times: dict[str, list[float]] = {}

    def timed(name: str, fn: Callable[[], object]) -> None:
        t0 = time.perf_counter()
        fn()
        times.setdefault(name, []).append(time.perf_counter() - t0)

    tmp = tempfile.mkdtemp(prefix="tt-bench-")
    os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("WANDB_SILENT", "true")
    os.environ.setdefault("WANDB_DIR", tmp)
    peers: dict[str, Callable[[int], None]] = {}
    if not args.no_peers:
        try:
            import wandb

            wrun = wandb.init(project="traintape-bench", mode="offline", dir=tmp)
            print(f"wandb {wandb.__version__} (offline)")

            def wandb_variant(r: int) -> None:
                wandb.watch(model, log="all", log_freq=1)
                for _ in range(args.steps):
                    timed("wandb", lambda: wrun.log({"loss": step()}))
                wandb.unwatch(model)

            peers["wandb"] = wandb_variant
        except ImportError:
            print("wandb not installed: skipped")
        try:
            from torch.utils.tensorboard import SummaryWriter

            writer = SummaryWriter(os.path.join(tmp, "tb"))
            named = list(model.named_parameters())
            gstep = [0]

            def tb_step() -> None:
                step()
                for n, p in named:
                    writer.add_histogram(n, p, gstep[0])
                    writer.add_histogram(n + "/grad", p.grad, gstep[0])
                gstep[0] += 1

            def tb_variant(r: int) -> None:
                for _ in range(args.steps):
                    timed("tensorboard", tb_step)

            peers["tensorboard"] = tb_variant
        except ImportError:
            print("tensorboard not installed: skipped")

    policy = traintape.CapturePolicy(every=1, kinds=("param", "grad"))
    rec = traintape.Recorder("memory://torch-bench", policy, flush_every_steps=10_000)
    rec_step = [0]

    def traintape_variant(r: int) -> None:
        with tt.watch(model, rec, optimizer=opt, start_step=rec_step[0], activations=False):
            for _ in range(args.steps):
                timed("traintape", step)
                rec_step[0] += 1

    def floor_sum() -> float:
        return sum(float(t.sum()) for t in params) + sum(float(p.grad.sum()) for p in params)

    def baseline_variant(r: int) -> None:
        for _ in range(args.steps):
            timed("baseline", step)
            timed("floor", floor_sum)  # one memory pass over params + grads
            timed("stats_direct", lambda: S.stat_vectors(params + [p.grad for p in params]))

    step()  # warm-up (allocates Adam state and grads)
    S.stat_vectors(params)  # compiles/loads the fused kernel
    variants = {"baseline": baseline_variant, "traintape": traintape_variant, **peers}
    for r in range(args.rounds):
        for fn in variants.values():
            fn(r)
    rec.close()

    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    base = med["baseline"]
    print("\nmedian ms/step:", ", ".join(f"{k} {v:.1f}" for k, v in med.items()))
    over = med["traintape"] - base
    print(f"floor (one sum pass over params+grads, {2 * n_params / 1e6:.1f}M elements): "
          f"{med['floor']:.2f} ms")  # fmt: skip
    print(f"traintape stats every step: overhead {over:.2f} ms = {over / med['floor']:.2f}x "
          f"floor, {100 * over / base:.2f}% of step (target <= 2x, <= 5%)")  # fmt: skip
    print(f"traintape stats call alone (params+grads): {med['stats_direct']:.2f} ms = "
          f"{med['stats_direct'] / med['floor']:.2f}x floor, "
          f"{100 * med['stats_direct'] / base:.2f}% of step")  # fmt: skip
    for k in peers:
        print(f"{k}: step {med[k] / base:.2f}x baseline ({med[k] - base:.1f} ms overhead, "
              f"{(med[k] - base) / max(over, 1e-9):.0f}x traintape's)")  # fmt: skip


if __name__ == "__main__":
    main()
