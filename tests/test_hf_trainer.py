"""traintape.transformers.Callback on a tiny GPT-2 Trainer run (CPU, from config).

References are Trainer's own numbers: ``p.grad`` read in ``on_pre_optimizer_step``
(the gradient ``optimizer.step()`` applies, after accumulation and clipping) and the
``loss``/``learning_rate``/``grad_norm`` Trainer logs in ``state.log_history``. The
recorded ``grad`` is pre-clip (docs/store-format.md): ``p.grad`` there divided by the
factor Trainer's clipping applied (from its own ``grad_norm``).
"""

from __future__ import annotations

import os

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import traintape  # noqa: E402
import traintape.transformers as ttf  # noqa: E402

STEPS = 6
ACCUM = 2
BATCH = 2


class _GradRef(transformers.TrainerCallback):
    """Per-entry grad l2 read from ``p.grad`` right before ``optimizer.step()``."""

    def __init__(self, cb: ttf.Callback) -> None:
        self.cb = cb
        self.rows: list[dict[str, float]] = []

    def on_pre_optimizer_step(self, args, state, control, **kw):  # type: ignore[no-untyped-def]
        h = self.cb.handle
        assert h is not None
        row = {}
        for e in h.train_entries:
            g = e.tensor().grad
            row[e.name] = float(e.part(g).double().norm()) if g is not None else 0.0
        self.rows.append(row)


def _train(out: str, max_grad_norm: float | None) -> tuple[traintape.Run, _GradRef, list]:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16)
    model = transformers.GPT2LMHeadModel(cfg)
    g = torch.Generator().manual_seed(1)
    data = [
        {"input_ids": ids, "labels": ids}
        for ids in torch.randint(0, 64, (STEPS * ACCUM * BATCH, 8), generator=g)
    ]
    args = transformers.TrainingArguments(
        output_dir=out + "_trainer",
        per_device_train_batch_size=BATCH,
        gradient_accumulation_steps=ACCUM,
        max_steps=STEPS,
        learning_rate=1e-3,
        logging_steps=1,
        max_grad_norm=max_grad_norm if max_grad_norm is not None else 0.0,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
    )
    with traintape.Recorder(out, traintape.CapturePolicy(full_every=3)) as rec:
        cb = ttf.Callback(rec)
        ref = _GradRef(cb)
        trainer = transformers.Trainer(
            model=model, args=args, train_dataset=data, callbacks=[cb, ref]
        )
        trainer.train()
        assert cb.handle is None  # hooks removed at on_train_end
    return traintape.open_run(out), ref, trainer.state.log_history


def _check_grads(run: traintape.Run, ref: _GradRef, factors: list[float] | None = None) -> None:
    """Recorded per-tensor grad l2 == ``p.grad``'s at the optimizer step / that step's
    clip factor (1 without clipping)."""
    assert run.steps.tolist() == list(range(STEPS))
    assert len(ref.rows) == STEPS
    df = run.stats("grad")
    for t, row in enumerate(ref.rows):
        got = df[df.step == t].set_index("tensor")["l2"]
        assert set(got.index) == set(row)
        c = 1.0 if factors is None else factors[t]
        for name, want in row.items():
            np.testing.assert_allclose(got[name], want / c, rtol=1e-4, atol=1e-8, err_msg=name)


def test_accumulated_grads_and_aligned_metrics(tmp_path) -> None:
    run, ref, history = _train(str(tmp_path / "run"), None)
    _check_grads(run, ref)
    m = run.metrics()
    logged = [h for h in history if "loss" in h and "learning_rate" in h]
    assert len(logged) == STEPS
    for h in logged:
        row = h["step"] - 1  # the optimizer step this log describes
        assert m.loc[row, "train/loss"] == pytest.approx(h["loss"], rel=1e-6)
        assert m.loc[row, "train/learning_rate"] == pytest.approx(h["learning_rate"], rel=1e-6)
    assert run.rows == STEPS  # no extra row from logging at state.global_step
    assert "grad/clip_factor" not in m.columns  # max_grad_norm=0: no clipping


def test_grad_is_pre_clip_and_the_clip_factor_is_logged(tmp_path) -> None:
    """max_grad_norm clips every step: recorded grad is the pre-clip gradient (its global
    l2 is Trainer's own grad_norm), grad/clip_factor is the factor Trainer applied."""
    max_norm = 0.05
    run, ref, history = _train(str(tmp_path / "run"), max_norm)
    m = run.metrics()
    df = run.stats("grad")
    logged = sorted((h for h in history if "grad_norm" in h), key=lambda h: h["step"])
    assert len(logged) == STEPS
    factors = []
    for h in logged:
        t = h["step"] - 1
        pre = float(h["grad_norm"])
        assert m.loc[t, "train/grad_norm"] == pytest.approx(pre, rel=1e-6)
        total = float(np.sqrt((df[df.step == t]["l2"] ** 2).sum()))
        np.testing.assert_allclose(total, pre, rtol=1e-6)  # pre-clip
        factor = min(1.0, max_norm / (pre + 1e-6))  # what clip_grad_norm_ multiplies by
        assert factor < 1.0
        np.testing.assert_allclose(m.loc[t, "grad/clip_factor"], factor, rtol=1e-5)
        factors.append(factor)
    _check_grads(run, ref, factors)


def test_deepspeed_is_refused(tmp_path) -> None:
    cb = ttf.Callback(traintape.Recorder(str(tmp_path / "r")))
    args = type("A", (), {"deepspeed": "ds.json"})()
    with pytest.raises(RuntimeError, match="DeepSpeed"):
        cb.on_train_begin(args, None, None, model=None, optimizer=None)  # type: ignore[arg-type]
    cb.recorder.close()


def test_gpt2_conv1d_is_dense_and_integer_buffers_are_skipped() -> None:
    import warnings

    from traintape.adapters.torch.names import model_layout

    torch.manual_seed(0)
    gpt = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16)
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "no canonical layout" warning
        lay = model_layout(gpt)
    by = {e.name: e for e in lay.entries}
    e = by["transformer/h/0/attn/c_attn/kernel"]
    assert e.layer_kind == "dense" and e.source_shape == (32, 96)  # (in, out) as stored
    w = gpt.transformer.h[0].attn.c_attn.weight
    np.testing.assert_array_equal(e.canonical(w).detach().numpy(), w.detach().numpy())
    bert = transformers.BertModel(
        transformers.BertConfig(
            num_hidden_layers=2,
            hidden_size=32,
            num_attention_heads=2,
            intermediate_size=64,
            vocab_size=64,
            max_position_embeddings=16,
        )
    )
    names = [e.name for e in model_layout(bert, warn=False).entries]
    assert not [n for n in names if "position_ids" in n or "token_type_ids" in n]


def test_peft_lora_trainer_records_lora_grads_only(tmp_path) -> None:
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16)
    model = peft.get_peft_model(
        transformers.GPT2LMHeadModel(cfg),
        peft.LoraConfig(r=4, target_modules=["c_attn"], fan_in_fan_out=True),
    )
    g = torch.Generator().manual_seed(1)
    data = [{"input_ids": x, "labels": x} for x in torch.randint(0, 64, (8, 8), generator=g)]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "t"),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=2,
        logging_steps=1,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
    )
    url = str(tmp_path / "run")
    with traintape.Recorder(url) as rec:
        cb = ttf.Callback(rec)
        ref = _GradRef(cb)
        transformers.Trainer(
            model=model, args=args, train_dataset=data, callbacks=[cb, ref]
        ).train()
    run = traintape.open_run(url)
    grads = run.tensor_names("grad")
    assert sorted(grads) == sorted(
        f"transformer/h/{i}/attn/c_attn/lora_{ab}/kernel" for i in range(2) for ab in "AB"
    )
    assert set(run.tensor_names("update")) == set(grads)
    assert "transformer/h/0/attn/c_attn/base_layer/kernel" in run.tensor_names("param")
    assert not [n for n in run.tensor_names("param") if n.startswith("base_model")]
    df = run.stats("grad")
    for t, row in enumerate(ref.rows):
        got = df[df.step == t].set_index("tensor")["l2"]
        for name, want in row.items():
            np.testing.assert_allclose(got[name], want, rtol=1e-4, atol=1e-8, err_msg=name)


class _Tracked(torch.utils.data.Dataset):
    """The training data, remembering the order Trainer reads it in."""

    def __init__(self, items: list) -> None:
        self.items, self.order = items, []

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int):  # type: ignore[no-untyped-def]
        self.order.append(int(i))
        return self.items[i]


def test_trainer_grads_equal_a_plain_loop_on_the_same_micro_batches(tmp_path) -> None:
    """Independent of Trainer: a plain torch loop (same init, same micro-batches in the
    order Trainer read them, AdamW with Trainer's defaults and linear schedule) computes
    the accumulated gradient of each step; traintape's recorded grad l2 must equal it.
    Dropout off: the two loops must compute the same function."""
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
    g = torch.Generator().manual_seed(1)
    items = [{"input_ids": x, "labels": x}
             for x in torch.randint(0, 64, (STEPS * ACCUM * BATCH, 8), generator=g)]  # fmt: skip
    data = _Tracked(items)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    init = {k: v.clone() for k, v in model.state_dict().items()}
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "t"), per_device_train_batch_size=BATCH,
        gradient_accumulation_steps=ACCUM, max_steps=STEPS, learning_rate=1e-3,
        logging_steps=1, max_grad_norm=0.0, use_cpu=True, report_to=[], save_strategy="no",
        disable_tqdm=True, seed=0, dataloader_num_workers=0,
    )  # fmt: skip
    url = str(tmp_path / "run")
    with traintape.Recorder(url) as rec:
        transformers.Trainer(model=model, args=args, train_dataset=data,
                             callbacks=[ttf.Callback(rec)]).train()  # fmt: skip
    order = data.order[: STEPS * ACCUM * BATCH]
    assert len(order) == STEPS * ACCUM * BATCH

    plain = transformers.GPT2LMHeadModel(cfg)
    plain.load_state_dict(init)
    plain.train()
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                            weight_decay=0.0)  # fmt: skip
    sched = transformers.get_linear_schedule_with_warmup(opt, 0, STEPS)
    df = traintape.open_run(url).stats("grad")
    from traintape.adapters.torch.names import model_layout

    entries = {e.name: e for e in model_layout(plain, warn=False).entries if e.trainable}
    for t in range(STEPS):
        opt.zero_grad()
        # Trainer's loss over an accumulation window: the summed token losses divided by
        # the number of label tokens in the window (num_items_in_batch, counted before the
        # causal shift: 8 per sequence), not the mean of the micro-batch means
        n_items = ACCUM * BATCH * 8
        for m in range(ACCUM):
            idx = order[(t * ACCUM + m) * BATCH : (t * ACCUM + m + 1) * BATCH]
            ids = torch.stack([items[i]["input_ids"] for i in idx])
            logits = plain(input_ids=ids).logits[:, :-1]
            loss = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="sum"
            )
            (loss / n_items).backward()
        got = df[df.step == t].set_index("tensor")["l2"]
        assert set(got.index) == set(entries)
        for name, e in entries.items():
            want = float(e.part(e.tensor().grad).double().norm())
            np.testing.assert_allclose(got[name], want, rtol=1e-4, atol=1e-7,
                                       err_msg=f"{name} at step {t}")  # fmt: skip
        opt.step()
        sched.step()
