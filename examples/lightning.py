"""Record a small Lightning module trained with ``accumulate_grad_batches=2``.

python examples/lightning.py runs/lightning [steps]
"""

from __future__ import annotations

import sys
from pathlib import Path

# run as a script, this file's folder is sys.path[0] and "lightning" would be this file
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import lightning as L  # noqa: E402
import torch  # noqa: E402

import traintape  # noqa: E402
import traintape.lightning  # noqa: E402


class Regressor(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 1)
        )

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def main(out: str = "runs/lightning", steps: int = 20) -> None:
    torch.manual_seed(0)
    x = torch.randn(steps * 2 * 16, 8)
    ds = torch.utils.data.TensorDataset(x, x[:, :1] * 2 - x[:, 1:2])
    with traintape.Recorder(out, traintape.CapturePolicy(full_every=10)) as rec:
        trainer = L.Trainer(
            max_steps=steps,
            accumulate_grad_batches=2,
            accelerator="cpu",
            callbacks=[traintape.lightning.Callback(rec)],
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(Regressor(), torch.utils.data.DataLoader(ds, batch_size=16))
    run = traintape.open_run(out)
    print(run.metrics().tail())
    print("valid:", traintape.validate(out).ok)


if __name__ == "__main__":
    main(*sys.argv[1:2], *(int(a) for a in sys.argv[2:3]))
