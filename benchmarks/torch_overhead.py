"""Overhead of traintape.torch.watch stats on a >= 10M-parameter MLP (CPU, 2 threads).

Variants, interleaved in rounds in one process (same model, same batch;
``benchmarks/_common.py``: rotating round-robin, per-round medians, paired deltas
against the baseline of the same round):

- ``baseline``: forward + backward + Adam step;
- ``traintape``: the same step under ``traintape.torch.watch`` recording ``param`` and
  ``grad`` stat vectors every step (``CapturePolicy(every=1, kinds=(param, grad))``,
  in-memory store);
- ``tt_grad_at_step``: the same, with ``grad`` read from ``p.grad`` at the optimizer
  step as before the pre-clip capture (no end-of-backward statistics, no norm check):
  the cost of the pre-clip ``grad`` capture is ``traintape`` − ``tt_grad_at_step``;
- ``wandb``: ``wandb.watch(model, log="all", log_freq=1)`` + ``wandb.log`` per step,
  ``WANDB_MODE=offline``;
- ``tensorboard``: ``SummaryWriter.add_histogram`` for every parameter and gradient
  every step.

In the baseline variant's rounds, two kernels are also timed in isolation on the same
params + grads: ``floor`` (one plain ``sum`` pass, the floor for stats capture) and
``stats_direct`` (the adapter's stat call alone).

Prints ms/step medians, traintape overhead / floor (from step times and from the stats
call timed directly) and overhead as % of the step, and the peers' step-time ratios.

``--hf``: the same comparison inside ``transformers.Trainer`` instead (a tiny GPT-2 from
config on the CPU; every variant runs ``--steps`` optimizer steps per round through its
own ``Trainer.train()``, each step timed from ``on_step_begin`` to ``on_step_end``):

- ``trainer``: ``report_to=[]``;
- ``traintape``: + ``traintape.transformers.Callback`` (param, grad, update stats every
  step, in-memory store; a new store per round since each ``train()`` restarts at step 0);
- ``tb+wandb``: Trainer's own ``report_to=["tensorboard", "wandb"]`` with
  ``WANDB_WATCH=all`` (WandbCallback's ``wandb.watch`` of params and grads, offline),
  ``logging_steps=1``.

``--clip``: every variant's step calls ``clip_grad_norm_(params, 1e-3)`` (clipping at
every step: the adapter measures the clip factor too).

Usage: python benchmarks/torch_overhead.py [--batch 512] [--rounds 12] [--steps 3]
[--threads 2] [--quick] [--no-peers] [--hf] [--clip]
"""

from __future__ import annotations

import argparse
import itertools
import os
import tempfile
import time
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
    ap.add_argument("--hf", action="store_true", help="the transformers.Trainer comparison")
    ap.add_argument("--clip", action="store_true", help="clip_grad_norm_ in every step")
    args = ap.parse_args()
    if args.hf:
        hf_trainer_main(args)
        return
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
        if args.clip:
            torch.nn.utils.clip_grad_norm_(params, 1e-3)
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

    def grad_at_step_variant(t: Timings) -> None:
        with tt.watch(model, rec, optimizer=opt, start_step=rec_step[0], activations=False) as h:
            h._bwd_queued = True  # never queue the end-of-backward capture: read at the step
            for _ in range(args.steps):
                t.timed("tt_grad_at_step", step)
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
    variants = {"baseline": baseline_variant, "traintape": traintape_variant,
                "tt_grad_at_step": grad_at_step_variant, **peers}  # fmt: skip
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
    pre = t.delta("traintape", "tt_grad_at_step")[0]
    print(f"pre-clip grad capture (traintape - tt_grad_at_step, paired): {pre:+.2f} ms/step "
          f"= {pre / floor:+.2f}x floor, {100 * pre / base:+.2f}% of step")  # fmt: skip
    for k in peers:
        d = t.delta(k, "baseline")[0]
        rel = f", {d / over:.0f}x traintape's" if over > 0 else ""
        print(f"{k}: step {t.ratio(k, 'baseline'):.2f}x baseline ({d:.1f} ms overhead{rel})")


def hf_trainer_main(args: argparse.Namespace) -> None:
    """``--hf``: Trainer vs Trainer + traintape vs Trainer's tensorboard + wandb watch."""
    os.environ.setdefault("USE_TF", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    tmp = tempfile.mkdtemp(prefix="tt-bench-hf-")
    for k, v in {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DIR": tmp}.items():
        os.environ.setdefault(k, v)
    import transformers

    import traintape.transformers

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("TRAINTAPE_FUSED_THREADS", str(args.threads))
    quick = args.quick
    if quick:
        args.rounds, args.steps = 2, 3
    steps = max(args.steps, 3)  # the first step of each train() carries set-up: medians drop it
    layers, width, seq, batch = (2, 32, 16, 2) if quick else (4, 256, 128, 8)
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        n_layer=layers, n_embd=width, n_head=4, vocab_size=1024, n_positions=seq
    )
    model = transformers.GPT2LMHeadModel(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    ids = torch.randint(0, cfg.vocab_size, (steps * batch, seq))
    data = [{"input_ids": x, "labels": x} for x in ids]
    print(f"model: GPT-2 {layers} layers x {width}, {n_params / 1e6:.2f}M params, batch {batch}"
          f" x {seq} tokens, {args.threads} threads, torch {torch.__version__}, "
          f"transformers {transformers.__version__}")  # fmt: skip

    class StepTimer(transformers.TrainerCallback):
        def __init__(self, t: Timings, name: str) -> None:
            self.t, self.name, self.t0 = t, name, 0.0

        def on_step_begin(self, *a: object, **k: object) -> None:
            self.t0 = time.perf_counter()

        def on_step_end(self, *a: object, **k: object) -> None:
            dt = time.perf_counter() - self.t0
            self.t.rounds.setdefault(self.name, {}).setdefault(self.t.round, []).append(dt)

    def train(t: Timings, name: str, report_to: list[str], extra: list[object]) -> None:
        targs = transformers.TrainingArguments(
            output_dir=os.path.join(tmp, name), per_device_train_batch_size=batch,
            max_steps=steps, logging_steps=1, use_cpu=True, report_to=report_to,
            save_strategy="no", disable_tqdm=True, dataloader_num_workers=0,
        )  # fmt: skip
        cbs = [*extra, StepTimer(t, name)]
        trainer = transformers.Trainer(model=model, args=targs, train_dataset=data, callbacks=cbs)
        trainer.remove_callback(transformers.PrinterCallback)  # no log dicts on stdout
        trainer.train()

    policy = traintape.CapturePolicy(every=1, kinds=("param", "grad", "update"))
    count = itertools.count()

    def with_traintape(t: Timings) -> None:
        rec = traintape.Recorder(f"memory://hf-bench-{next(count)}", policy)
        train(t, "traintape", [], [traintape.transformers.Callback(rec, activations=False)])
        rec.close()

    variants: dict[str, Callable[[Timings], None]] = {
        "trainer": lambda t: train(t, "trainer", [], []),
        "traintape": with_traintape,
    }
    if not args.no_peers:
        try:
            import tensorboard  # noqa: F401
            import wandb  # noqa: F401

            os.environ["WANDB_WATCH"] = "all"
            variants["tb+wandb"] = lambda t: train(t, "tb+wandb", ["tensorboard", "wandb"], [])
        except ImportError:
            print("tensorboard or wandb not installed: peers skipped")
    t = interleave(variants, args.rounds)
    print_table(t, "trainer", list(variants))
    over = t.delta("traintape", "trainer")[0]
    base = t.median("trainer")
    print(f"\ntraintape callback (param+grad+update stats every step): "
          f"{over:.2f} ms/step = {100 * over / base:.1f}% of the Trainer step")  # fmt: skip
    if "tb+wandb" in variants:
        d = t.delta("tb+wandb", "trainer")[0]
        rel = f", {d / over:.0f}x traintape's" if over > 0 else ""
        print(f"tensorboard + wandb watch=all: step {t.ratio('tb+wandb', 'trainer'):.2f}x "
              f"({d:.1f} ms/step overhead{rel})")  # fmt: skip


if __name__ == "__main__":
    main()
