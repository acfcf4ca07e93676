"""Overhead of traintape.torch.watch stats on a >= 10M-parameter MLP (CPU, 2 threads).

Variants, interleaved in rounds in one process (same model, same batch;
``benchmarks/_common.py``: rotating round-robin, per-round medians, paired deltas
against the baseline of the same round):

- ``baseline``: forward + backward + Adam step;
- ``traintape``: the same step under ``traintape.torch.watch`` recording ``param`` and
  ``grad`` stat vectors every step (``CapturePolicy(every=1, kinds=(param, grad))``,
  in-memory store);
- ``wandb``: ``wandb.watch(model, log="all", log_freq=1)`` + ``wandb.log`` per step,
  ``WANDB_MODE=offline``;
- ``tensorboard``: ``SummaryWriter.add_histogram`` for every parameter and gradient
  every step.

In the baseline variant's rounds, two kernels are also timed in isolation on the same
params + grads: ``floor`` (one plain ``sum`` pass, the floor for stats capture) and
``stats_direct`` (the adapter's stat call alone).

Prints ms/step medians, traintape overhead / floor (from step times and from the stats
call timed directly) and overhead as % of the step, and the peers' step-time ratios.
Usage: python benchmarks/torch_overhead.py [--batch 512] [--rounds 12] [--steps 3]
[--threads 2] [--quick] [--no-peers]
"""

from __future__ import annotations

import argparse
import itertools
import os
import tempfile
from collections.abc import Callable

import torch
from _common import (
    Timings,
    add_common_args,
    apply_quick,
    interleave,
    overhead_line,
    print_table,
    repeat,
)
from torch import nn

import traintape
import traintape.torch as tt
from traintape.adapters.torch import stats as S


def make_model(sizes: list[int]) -> nn.Sequential:
    """Linear/ReLU MLP with these widths (no ReLU after the last layer)."""
    layers: list[nn.Module] = []
    for a, b in itertools.pairwise(sizes):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(ap, rounds=12, steps=3)
    ap.add_argument("--no-peers", action="store_true", help="skip wandb / tensorboard")
    args = ap.parse_args()
    sizes = apply_quick(args)
    torch.set_num_threads(args.threads)
    os.environ.setdefault("TRAINTAPE_FUSED_THREADS", str(args.threads))
    torch.manual_seed(0)
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

    tmp = tempfile.mkdtemp(prefix="tt-bench-")
    os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("WANDB_SILENT", "true")
    os.environ.setdefault("WANDB_DIR", tmp)
    peers: dict[str, Callable[[Timings], None]] = {}
    if not args.no_peers:
        try:
            import wandb

            wrun = wandb.init(project="traintape-bench", mode="offline", dir=tmp)
            print(f"wandb {wandb.__version__} (offline)")

            def wandb_variant(t: Timings) -> None:
                wandb.watch(model, log="all", log_freq=1)
                for _ in range(args.steps):
                    t.timed("wandb", lambda: wrun.log({"loss": step()}))
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

            peers["tensorboard"] = repeat("tensorboard", tb_step, args.steps)
        except ImportError:
            print("tensorboard not installed: skipped")

    policy = traintape.CapturePolicy(every=1, kinds=("param", "grad"))
    rec = traintape.Recorder("memory://torch-bench", policy, flush_every_steps=10_000)
    rec_step = [0]

    def traintape_variant(t: Timings) -> None:
        with tt.watch(model, rec, optimizer=opt, start_step=rec_step[0], activations=False):
            for _ in range(args.steps):
                t.timed("traintape", step)
                rec_step[0] += 1

    def floor_sum() -> float:
        with torch.no_grad():
            return sum(float(t.sum()) for t in params) + sum(float(p.grad.sum()) for p in params)

    def baseline_variant(t: Timings) -> None:
        for _ in range(args.steps):
            t.timed("baseline", step)
            t.timed("floor", floor_sum)  # one memory pass over params + grads
            t.timed("stats_direct", lambda: S.stat_vectors(params + [p.grad for p in params]))

    step()  # warm-up (allocates Adam state and grads)
    S.stat_vectors(params)  # compiles/loads the fused kernel
    variants = {"baseline": baseline_variant, "traintape": traintape_variant, **peers}
    t = interleave(variants, args.rounds)
    rec.close()

    base = t.median("baseline")
    print_table(t, "baseline", list(variants))
    over = t.delta("traintape", "baseline")[0]
    floor, direct = t.median("floor"), t.median("stats_direct")
    print(f"\nfloor (one sum pass over params+grads, {2 * n_params / 1e6:.1f}M elements, "
          f"isolated): {floor:.2f} ms")  # fmt: skip
    print(overhead_line("traintape stats every step, in-step", over, floor, base))
    print(overhead_line("traintape stats call alone (params+grads)", direct, floor, base)
          + f"; {t.ratio('stats_direct', 'floor'):.2f}x paired")  # fmt: skip
    for k in peers:
        d = t.delta(k, "baseline")[0]
        rel = f", {d / over:.0f}x traintape's" if over > 0 else ""
        print(f"{k}: step {t.ratio(k, 'baseline'):.2f}x baseline ({d:.1f} ms overhead{rel})")


if __name__ == "__main__":
    main()
