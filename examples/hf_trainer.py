"""Record a tiny GPT-2 (from config, random init) trained by ``transformers.Trainer``.

python examples/hf_trainer.py runs/hf_trainer [steps]
"""

from __future__ import annotations

import os
import sys
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
import transformers

import traintape
import traintape.transformers


def main(out: str = "runs/hf_trainer", steps: int = 6) -> None:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16)
    model = transformers.GPT2LMHeadModel(cfg)
    ids = torch.randint(0, 64, (steps * 4, 8))
    data = [{"input_ids": x, "labels": x} for x in ids]
    args = transformers.TrainingArguments(
        output_dir=tempfile.mkdtemp(),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=steps,
        logging_steps=1,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
    )
    with traintape.Recorder(out, traintape.CapturePolicy(full_every=5)) as rec:
        cb = traintape.transformers.Callback(rec)
        transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=[cb]).train()
    run = traintape.open_run(out)
    print(run.metrics()[["train/loss", "train/learning_rate", "train/grad_norm"]])
    print("valid:", traintape.validate(out).ok)


if __name__ == "__main__":
    main(*sys.argv[1:2], *(int(a) for a in sys.argv[2:3]))
