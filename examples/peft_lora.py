"""Record a LoRA fine-tune (PEFT) of a tiny GPT-2 built from config with ``Trainer``.

Only the LoRA adapters get ``grad``/``update``: ``.../c_attn/lora_A/kernel``.

python examples/peft_lora.py runs/peft_lora [steps]
"""

from __future__ import annotations

import os
import sys
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import peft
import torch
import transformers

import traintape
import traintape.transformers


def main(out: str = "runs/peft_lora", steps: int = 6) -> None:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16)
    lora = peft.LoraConfig(r=4, target_modules=["c_attn"], fan_in_fan_out=True)
    model = peft.get_peft_model(transformers.GPT2LMHeadModel(cfg), lora)
    ids = torch.randint(0, 64, (steps * 2, 8))
    args = transformers.TrainingArguments(
        output_dir=tempfile.mkdtemp(),
        per_device_train_batch_size=2,
        max_steps=steps,
        logging_steps=1,
        learning_rate=1e-3,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
    )
    data = [{"input_ids": x, "labels": x} for x in ids]
    with traintape.Recorder(out, traintape.CapturePolicy(full_every=5)) as rec:
        cb = traintape.transformers.Callback(rec)
        transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=[cb]).train()
    run = traintape.open_run(out)
    print("grad:", run.tensor_names("grad"))
    print("valid:", traintape.validate(out).ok)


if __name__ == "__main__":
    main(*sys.argv[1:2], *(int(a) for a in sys.argv[2:3]))
