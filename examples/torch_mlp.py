"""Record a small PyTorch MLP with traintape, then read the run back.

python examples/torch_mlp.py runs/torch_mlp
"""

from __future__ import annotations

import sys

import torch
from torch import nn

import traintape
import traintape.torch


def main(out: str = "runs/torch_mlp", steps: int = 20) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.LayerNorm(64), nn.GELU(), nn.Linear(64, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    policy = traintape.CapturePolicy(every=1, full_every=10)
    probe = torch.randn(4, 16)
    with (
        traintape.Recorder(out, policy) as rec,
        traintape.torch.watch(model, rec, optimizer=opt, probe=probe) as handle,
    ):
        for _ in range(steps):
            x = torch.randn(32, 16)
            y = x[:, :1] * 2 - x[:, 1:2]
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            rec.log(handle.step_index, loss=loss.item())
            opt.step()  # hooks record param (θ_t), grad, update and activations of step t
    run = traintape.open_run(out)
    print(run.tensor_names("param"))
    print(run.stats("grad").query("tensor == '0/kernel'")[["step", "l2", "nan_count"]].tail())
    print("valid:", traintape.validate(out).ok)


if __name__ == "__main__":
    main(*sys.argv[1:2])
