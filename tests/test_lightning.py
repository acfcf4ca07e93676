"""traintape.lightning.Callback against a plain torch loop on the same micro-batches."""

from __future__ import annotations

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")
L = pytest.importorskip("lightning")

import traintape  # noqa: E402
import traintape.lightning as ttl  # noqa: E402

STEPS = 4
ACCUM = 2


class _Module(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)
        )

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        (torch.randn(3, 4, generator=g), torch.randn(3, 1, generator=g))
        for _ in range(STEPS * ACCUM)
    ]


def _plain(mod: _Module) -> list[dict[str, np.ndarray]]:
    opt = torch.optim.SGD(mod.parameters(), lr=0.1, momentum=0.9)
    out = []
    bs = _batches()
    for t in range(STEPS):
        opt.zero_grad()
        for x, y in bs[t * ACCUM : (t + 1) * ACCUM]:
            (torch.nn.functional.mse_loss(mod.net(x), y) / ACCUM).backward()
        out.append({n: p.grad.detach().clone().numpy() for n, p in mod.named_parameters()})
        opt.step()
    return out


def test_accumulated_grads_equal_plain_loop(tmp_path) -> None:
    torch.manual_seed(0)
    mod = _Module()
    ref = _plain(copy.deepcopy(mod))
    url = str(tmp_path / "run")
    with traintape.Recorder(url, traintape.CapturePolicy(full_every=1)) as rec:
        trainer = L.Trainer(
            max_steps=STEPS,
            accumulate_grad_batches=ACCUM,
            callbacks=[ttl.Callback(rec)],
            accelerator="cpu",
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(mod, torch.utils.data.DataLoader(_batches(), batch_size=None))
    run = traintape.open_run(url)
    assert run.steps.tolist() == list(range(STEPS))
    for t in range(STEPS):
        for i in (0, 2):
            w = ref[t][f"net.{i}.weight"]
            np.testing.assert_allclose(
                run.snapshot(f"net/{i}/kernel", "grad", t), w.T, rtol=1e-5, atol=1e-7
            )
            b = ref[t][f"net.{i}.bias"]
            np.testing.assert_allclose(
                run.snapshot(f"net/{i}/bias", "grad", t), b, rtol=1e-5, atol=1e-7
            )
    m = run.metrics()
    assert "train/loss" in m.columns and m["train/loss"].notna().sum() == STEPS


def test_grad_is_pre_clip_with_gradient_clip_val(tmp_path) -> None:
    """gradient_clip_val clips inside Lightning's closure, after backward: the recorded
    grad is the pre-clip gradient of the plain loop (its global l2 is clip_grad_norm_'s
    total norm) and grad/clip_factor the factor clip_grad_norm_ applied."""
    max_norm = 0.05
    torch.manual_seed(0)
    mod = _Module()
    plain = copy.deepcopy(mod)
    opt = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    ref, totals, factors = [], [], []
    bs = _batches()
    for t in range(STEPS):
        opt.zero_grad()
        for x, y in bs[t * ACCUM : (t + 1) * ACCUM]:
            (torch.nn.functional.mse_loss(plain.net(x), y) / ACCUM).backward()
        ref.append({n: p.grad.detach().clone().numpy() for n, p in plain.named_parameters()})
        g0 = plain.net[0].weight.grad.detach().clone()
        totals.append(float(torch.nn.utils.clip_grad_norm_(plain.parameters(), max_norm)))
        factors.append(float(plain.net[0].weight.grad.norm() / g0.norm()))  # as applied
        opt.step()
    url = str(tmp_path / "run")
    with traintape.Recorder(url, traintape.CapturePolicy(full_every=1)) as rec:
        trainer = L.Trainer(
            max_steps=STEPS,
            accumulate_grad_batches=ACCUM,
            gradient_clip_val=max_norm,
            callbacks=[ttl.Callback(rec)],
            accelerator="cpu",
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(mod, torch.utils.data.DataLoader(_batches(), batch_size=None))
    run = traintape.open_run(url)
    df = run.stats("grad")
    m = run.metrics()
    for t in range(STEPS):
        total = float(np.sqrt((df[df.step == t]["l2"] ** 2).sum()))
        np.testing.assert_allclose(total, totals[t], rtol=1e-5)
        assert factors[t] < 1.0
        np.testing.assert_allclose(m.loc[t, "grad/clip_factor"], factors[t], rtol=1e-5)
        w = ref[t]["net.0.weight"]
        np.testing.assert_allclose(
            run.snapshot("net/0/kernel", "grad", t), w.T, rtol=1e-5, atol=1e-7
        )
