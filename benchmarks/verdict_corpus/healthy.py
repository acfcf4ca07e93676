"""Healthy trainings of the health corpus: real models trained the way users train them,
each reaching a low loss. The right verdict: no critical, no warning (info is fine).

Every ``record_*`` function trains for real, records with a traintape adapter into
``workdir/<case name>`` and returns that path.
"""

from __future__ import annotations

import os
from pathlib import Path

from .health_case import HealthCase

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("USE_TF", "0")  # transformers: torch only (Keras 3 is installed)
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # Keras cases: no TF start-up chatter


# ---------------------------------------------------------------- torch: small nets


def record_mlp_adam(workdir: Path) -> Path:
    """A 3-layer ReLU MLP on a teacher classification task, Adam 3e-3, 300 steps."""
    import torch

    from . import torch_training as T

    out = workdir / "mlp_adam"
    x, y = T.teacher_task(16, 4)
    model = T.mlp([16, 64, 64, 4])
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    T.train(T.fresh(out), model, opt, T.shuffled(x, y, 64), T.ce, 300)
    return out


def record_mlp_regression_sgd(workdir: Path) -> Path:
    """A 3-layer tanh MLP regressing a teacher's outputs (MSE), SGD lr 0.05 momentum 0.9,
    300 steps."""
    import torch
    from torch import nn

    from . import torch_training as T

    out = workdir / "mlp_regression_sgd"
    x, y = T.teacher_regression(16, 4)
    model = T.mlp([16, 64, 64, 4], act=nn.Tanh)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    T.train(T.fresh(out), model, opt, T.shuffled(x, y, 64), T.mse, 300)
    return out


def _images(n: int = 1024, seed: int = 0, size: int = 12, classes: int = 4):
    """``[n, 1, size, size]`` images: one of ``classes`` random ±1 templates, rolled by up
    to 2 pixels each way, plus Gaussian noise (std 0.5); labels ``[n]``."""
    import torch

    g = torch.Generator().manual_seed(seed)
    templates = torch.sign(torch.randn(classes, size, size, generator=g))
    y = torch.randint(0, classes, (n,), generator=g)
    shifts = torch.randint(-2, 3, (n, 2), generator=g)
    x = torch.stack(
        [
            torch.roll(templates[c], (int(s[0]), int(s[1])), (0, 1))
            for c, s in zip(y, shifts, strict=True)
        ]
    )
    x = x + 0.5 * torch.randn(x.shape, generator=g)
    return x[:, None], y


def cnn(seed: int = 0):
    """Conv-BN-ReLU ×2, global average pool, linear head (layers ``0``, ``1``, ``4``,
    ``5``, ``9``)."""
    import torch
    from torch import nn

    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 4),
    )  # fmt: skip


def record_cnn_bn_sgd(workdir: Path) -> Path:
    """A small CNN with BatchNorm, SGD momentum 0.9 lr 0.05, 200 steps of 64 images."""
    import torch

    from . import torch_training as T

    out = workdir / "cnn_bn_sgd"
    x, y = _images()
    model = cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    T.train(T.fresh(out), model, opt, T.shuffled(x, y, 64), T.ce, 200)
    return out


def _sign_sequences(n: int = 2048, length: int = 10, feat: int = 4, seed: int = 0):
    """``[n, length, feat]`` Gaussian sequences; label 1 when the sum over time of feature
    0 is positive (the net must integrate over the whole sequence)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, length, feat, generator=g)
    return x, (x[:, :, 0].sum(1) > 0).long()


class _LSTMClassifier:  # built lazily (torch imported inside the case)
    @staticmethod
    def build(seed: int = 0, forget_bias: float | None = None):
        import torch
        from torch import nn

        class LSTMClassifier(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.lstm = nn.LSTM(4, 32, batch_first=True)
                self.head = nn.Linear(32, 2)

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                h, _ = self.lstm(x)
                return self.head(h[:, -1])

        torch.manual_seed(seed)
        m = LSTMClassifier()
        if forget_bias is not None:  # gate order i, f, g, o; bias_ih + bias_hh
            with torch.no_grad():
                for b in (m.lstm.bias_ih_l0, m.lstm.bias_hh_l0):
                    b[32:64] = forget_bias / 2
        return m


def record_lstm(workdir: Path) -> Path:
    """An LSTM classifier (sum of a feature over 10 steps > 0), Adam 1e-2, 250 steps."""
    import torch

    from . import torch_training as T

    out = workdir / "lstm"
    x, y = _sign_sequences()
    model = _LSTMClassifier.build()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    T.train(T.fresh(out), model, opt, T.shuffled(x, y, 64), T.ce, 250)
    return out


# ---------------------------------------------------------------- transformers


def _token_task(n: int = 2048, length: int = 12, vocab: int = 32, token: int = 5, seed: int = 0):
    """``[n, length]`` token ids (position 0 is the ``[CLS]`` id 1, the rest uniform over
    ``2..vocab-1``); label 1 when ``token`` occurs (attention must find it)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, vocab, (n, length), generator=g)
    ids[:, 0] = 1
    return ids, (ids[:, 1:] == token).any(1).long()


def tiny_bert(seed: int = 0, num_labels: int = 2):
    import torch
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.BertConfig(
        vocab_size=32, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=16, num_labels=num_labels,
    )  # fmt: skip
    return transformers.BertForSequenceClassification(cfg)


def _logits_ce(model, x, y):
    import torch

    return torch.nn.functional.cross_entropy(model(input_ids=x).logits, y)


def record_bert_from_init(workdir: Path) -> Path:
    """HF ``BertForSequenceClassification`` from a tiny config (2 layers, 2 heads, hidden
    32), AdamW 1e-3 (weight decay 0.01) with ``clip_grad_norm_(1.0)``, 200 steps: the run
    issue 24 found called critical (VANISHING on every q/k/LayerNorm)."""
    import torch

    from . import torch_training as T

    out = workdir / "bert_from_init"
    x, y = _token_task()
    model = tiny_bert()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    T.train(T.fresh(out), model, opt, T.shuffled(x, y, 32), _logits_ce, 200, clip=1.0,
            user={"attention_heads": 2})  # fmt: skip
    return out


HEADS = 4


def mha_classifier(seed: int = 0, vocab: int = 32, d: int = 32):
    """A one-block post-norm transformer classifier written by hand: token + position
    embeddings, ``nn.MultiheadAttention`` (``HEADS`` heads, batch first) with residual and
    LayerNorm, a GELU MLP with residual, a linear head on position 0. Layers ``emb``,
    ``pos``, ``attn``, ``norm``, ``mlp/0``, ``mlp/2``, ``head``."""
    import torch
    from torch import nn

    class MHAClassifier(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(vocab, d)
            self.pos = nn.Embedding(16, d)
            self.attn = nn.MultiheadAttention(d, HEADS, batch_first=True)
            self.norm = nn.LayerNorm(d)
            self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
            self.head = nn.Linear(d, 2)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            h = self.emb(ids) + self.pos(torch.arange(ids.shape[1]))
            a, _ = self.attn(h, h, h, need_weights=False)
            h = self.norm(h + a)
            h = h + self.mlp(h)
            return self.head(h[:, 0])

    torch.manual_seed(seed)
    return MHAClassifier()


def record_mha_classifier(workdir: Path) -> Path:
    """:func:`mha_classifier` on "token 5 occurs", AdamW 1e-3 + ``clip_grad_norm_(1.0)``,
    200 steps (attention heads declared: the head check runs)."""
    import torch

    from . import torch_training as T

    out = workdir / "mha_classifier"
    x, y = _token_task()
    model = mha_classifier()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    T.train(T.fresh(out), model, opt, T.shuffled(x, y, 32), T.ce, 200, clip=1.0,
            user={"attention_heads": HEADS})  # fmt: skip
    return out


def _shift_sequences(n: int = 1024, length: int = 12, vocab: int = 32, shift: int = 1,
                     seed: int = 0):  # fmt: skip
    """``[n, length]`` token ids counting up by ``shift`` modulo ``vocab`` from a random
    start: every next token is determined by the previous one (an LM can reach ~0 loss)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, vocab, (n, 1), generator=g)
    return (start + shift * torch.arange(length)) % vocab


def tiny_gpt2(seed: int = 0):
    import torch
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=32,
                                  n_positions=16)  # fmt: skip
    return transformers.GPT2LMHeadModel(cfg)


def record_gpt2_trainer(workdir: Path) -> Path:
    """HF ``GPT2LMHeadModel`` from a tiny config trained by ``transformers.Trainer``
    (AdamW 3e-3, linear decay, ``max_grad_norm`` 1.0, batch 16, 150 steps) with
    ``traintape.transformers.Callback``; the task: count up modulo the vocabulary."""
    import transformers

    import traintape
    import traintape.transformers as ttf

    from . import torch_training as T

    out = workdir / "gpt2_trainer"
    ids = _shift_sequences()
    data = [{"input_ids": x, "labels": x} for x in ids]
    model = tiny_gpt2()
    args = transformers.TrainingArguments(
        output_dir=str(workdir / "_gpt2_trainer_output"), per_device_train_batch_size=16,
        max_steps=150, learning_rate=3e-3, logging_steps=1, max_grad_norm=1.0,
        use_cpu=True, report_to=[], save_strategy="no", disable_tqdm=True, seed=0,
    )  # fmt: skip
    with (
        T.one_thread(),
        traintape.Recorder(T.fresh(out), T.policy(), user={"attention_heads": 2}) as rec,
    ):
        trainer = transformers.Trainer(model=model, args=args, train_dataset=data,
                                       callbacks=[ttf.Callback(rec)])  # fmt: skip
        trainer.remove_callback(transformers.trainer_callback.PrinterCallback)  # quiet
        trainer.train()
    return out


def record_bert_finetune(workdir: Path) -> Path:
    """Fine-tuning a pretrained model: the tiny BERT is first trained (unrecorded) on
    "token 5 occurs" (200 steps), saved with ``save_pretrained``, reloaded with
    ``from_pretrained`` and fine-tuned (recorded) on "token 9 occurs": AdamW 1e-3, clip
    1.0, 200 steps."""
    import torch
    import transformers

    from . import torch_training as T

    out = workdir / "bert_finetune"
    x, y = _token_task()
    base = tiny_bert()
    opt = torch.optim.AdamW(base.parameters(), lr=1e-3, weight_decay=0.01)
    batch = T.shuffled(x, y, 32)
    with T.one_thread():
        for t in range(200):  # pretraining, not recorded
            xb, yb = batch(t)
            opt.zero_grad()
            _logits_ce(base, xb, yb).backward()
            torch.nn.utils.clip_grad_norm_(base.parameters(), 1.0)
            opt.step()
    saved = workdir / "_bert_pretrained"
    base.save_pretrained(saved)
    model = transformers.BertForSequenceClassification.from_pretrained(saved)
    x2, y2 = _token_task(token=9, seed=1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    T.train(T.fresh(out), model, opt, T.shuffled(x2, y2, 32), _logits_ce, 200, clip=1.0,
            user={"attention_heads": 2})  # fmt: skip
    return out


def _lm_loss(model, x, _y):
    return model(input_ids=x, labels=x).loss


def record_gpt2_lora(workdir: Path) -> Path:
    """LoRA (PEFT, r 8 on ``c_attn`` and ``c_fc``) on a tiny GPT-2 first trained
    (unrecorded) to count up by 1, fine-tuned (recorded, ``traintape.torch.watch``) to
    count up by 3: AdamW 3e-3, 150 steps; only the adapters train."""
    import peft
    import torch

    from . import torch_training as T

    out = workdir / "gpt2_lora"
    base = tiny_gpt2()
    ids = _shift_sequences()
    batch = T.shuffled(ids, ids[:, 0], 16)
    opt = torch.optim.AdamW(base.parameters(), lr=3e-3)
    with T.one_thread():
        for t in range(100):  # pretraining, not recorded
            xb, _ = batch(t)
            opt.zero_grad()
            _lm_loss(base, xb, None).backward()
            opt.step()
    cfg = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["c_attn", "c_fc"],
                          fan_in_fan_out=True, lora_dropout=0.0)  # fmt: skip
    model = peft.get_peft_model(base, cfg)
    ids3 = _shift_sequences(shift=3, seed=1)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    T.train(T.fresh(out), model, opt, T.shuffled(ids3, ids3[:, 0], 16), _lm_loss, 150,
            user={"attention_heads": 2})  # fmt: skip
    return out


# ---------------------------------------------------------------- JAX / Flax


def _np_teacher(n_in: int = 16, n_cls: int = 4, pool: int = 2048, seed: int = 0):
    """The torch teacher task as numpy arrays (float32 inputs, int32 labels)."""
    from . import torch_training as T

    x, y = T.teacher_task(n_in, n_cls, pool=pool, seed=seed)
    return x.numpy(), y.numpy().astype("int32")


def _batches(n: int, batch: int, steps: int, seed: int = 1):
    """Index arrays of epoch-wise shuffled batches over a pool of ``n``."""
    import numpy as np

    rng = np.random.default_rng(seed)
    per = n // batch
    idx = np.concatenate([rng.permutation(n)[: per * batch] for _ in range(steps // per + 1)])
    return idx[: steps * batch].reshape(steps, batch)


def record_nnx_mlp(workdir: Path) -> Path:
    """A Flax NNX MLP (``nnx.Linear`` ×3, GELU) on the teacher task, optax AdamW 3e-3
    through ``nnx.Optimizer`` with ``traintape.jax.watch``, grads and activations from
    ``traintape.jax.nnx_value_and_grad``; 300 steps."""
    import jax
    import optax
    from flax import nnx

    import traintape
    import traintape.jax as tj

    from . import torch_training as T

    class MLP(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.layers = nnx.List([nnx.Linear(16, 64, rngs=rngs), nnx.Linear(64, 64, rngs=rngs),
                                    nnx.Linear(64, 4, rngs=rngs)])  # fmt: skip

        def __call__(self, x: jax.Array) -> jax.Array:
            for lin in self.layers[:-1]:
                x = nnx.gelu(lin(x))
            return self.layers[-1](x)

    out = workdir / "nnx_mlp"
    x, y = _np_teacher()
    model = MLP(nnx.Rngs(0))
    with traintape.Recorder(T.fresh(out), T.policy()) as rec:
        vg = tj.nnx_value_and_grad(
            lambda m, xb, yb: optax.softmax_cross_entropy_with_integer_labels(m(xb), yb).mean(),
            recorder=rec,
        )
        opt = nnx.Optimizer(model, tj.watch(optax.adamw(3e-3), rec), wrt=nnx.Param)

        @nnx.jit
        def step(m, o, xb, yb):
            loss, g = vg(m, xb, yb)
            o.update(m, g)
            return loss

        for t, idx in enumerate(_batches(len(y), 64, 300)):
            rec.log(t, loss=float(step(model, opt, x[idx], y[idx])))
    return out


def record_linen_cnn(workdir: Path) -> Path:
    """A Flax Linen CNN (Conv-ReLU ×2, mean pool, Dense) on the template images, optax
    SGD momentum 0.9 lr 0.05 under ``traintape.jax.value_and_grad`` + ``watch``; 200 steps."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import optax

    import traintape
    import traintape.jax as tj

    from . import torch_training as T

    class CNN(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            x = nn.relu(nn.Conv(8, (3, 3), name="conv1")(x))
            x = nn.max_pool(x, (2, 2), (2, 2))
            x = nn.relu(nn.Conv(16, (3, 3), name="conv2")(x))
            return nn.Dense(4, name="head")(jnp.mean(x, axis=(1, 2)))

    out = workdir / "linen_cnn"
    xt, yt = _images()
    x, y = xt.permute(0, 2, 3, 1).numpy(), yt.numpy().astype("int32")
    model = CNN()
    params = model.init(jax.random.key(0), x[:1])
    with traintape.Recorder(T.fresh(out), T.policy()) as rec:

        def loss_fn(p, xb, yb):
            logits = model.apply(p, xb)
            return optax.softmax_cross_entropy_with_integer_labels(logits, yb).mean()

        vg = tj.value_and_grad(loss_fn, recorder=rec)
        tx = tj.watch(optax.sgd(0.05, momentum=0.9), rec)
        state = tx.init(params)

        @jax.jit
        def step(p, s, xb, yb):
            loss, g = vg(p, xb, yb)
            u, s = tx.update(g, s, p)
            return optax.apply_updates(p, u), s, loss

        for t, idx in enumerate(_batches(len(y), 64, 200)):
            params, state, loss = step(params, state, x[idx], y[idx])
            rec.log(t, loss=float(loss))
    return out


def record_demo(workdir: Path) -> Path:
    """``traintape demo``'s run (Flax Linen MLP on spirals, Adam 3e-3, 300 steps)."""
    from traintape.demo import run_demo

    out = workdir / "demo"
    run_demo(str(out), progress=False)
    return out


# ---------------------------------------------------------------- Keras


def record_keras_mlp(workdir: Path) -> Path:
    """A Keras 3 ``Sequential`` MLP (Dense-ReLU ×2, Dense) on the teacher task,
    ``model.fit`` with Adam 3e-3, batch 64, 8 epochs (256 steps), with
    ``traintape.keras.Callback``."""
    import keras

    import traintape
    import traintape.keras as tk

    from . import torch_training as T

    out = workdir / "keras_mlp"
    x, y = _np_teacher()
    keras.utils.set_random_seed(0)
    L = keras.layers
    model = keras.Sequential([keras.Input((16,)), L.Dense(64, activation="relu", name="fc1"),
                              L.Dense(64, activation="relu", name="fc2"),
                              L.Dense(4, name="head")])  # fmt: skip
    model.compile(optimizer=keras.optimizers.Adam(3e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))  # fmt: skip
    with traintape.Recorder(T.fresh(out), T.policy()) as rec:
        model.fit(x, y, batch_size=64, epochs=8, verbose=0, shuffle=True,
                  callbacks=[tk.Callback(rec)])  # fmt: skip
    return out


def record_keras_cnn_bn(workdir: Path) -> Path:
    """A Keras 3 CNN (Conv-BatchNorm-ReLU ×2, global average pool, Dense) on the template
    images, ``model.fit`` with SGD momentum 0.9 lr 0.05, batch 64, 8 epochs (128 steps)."""
    import keras

    import traintape
    import traintape.keras as tk

    from . import torch_training as T

    out = workdir / "keras_cnn_bn"
    xt, yt = _images()
    x, y = xt.permute(0, 2, 3, 1).numpy(), yt.numpy()
    keras.utils.set_random_seed(0)
    L = keras.layers
    model = keras.Sequential([
        keras.Input((12, 12, 1)), L.Conv2D(8, 3, padding="same", name="conv1"),
        L.BatchNormalization(name="bn1"), L.ReLU(), L.MaxPooling2D(2),
        L.Conv2D(16, 3, padding="same", name="conv2"), L.BatchNormalization(name="bn2"),
        L.ReLU(), L.GlobalAveragePooling2D(), L.Dense(4, name="head"),
    ])  # fmt: skip
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))  # fmt: skip
    with traintape.Recorder(T.fresh(out), T.policy()) as rec:
        model.fit(x, y, batch_size=64, epochs=8, verbose=0, shuffle=True,
                  callbacks=[tk.Callback(rec)])  # fmt: skip
    return out


def record_gru(workdir: Path) -> Path:
    """A GRU classifier (the LSTM case's task and head), Adam 1e-2, 250 steps (the gate
    checks' GRU side: its reset gate gets little gradient early by design)."""
    import torch
    from torch import nn

    from . import torch_training as T

    class GRUClassifier(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gru = nn.GRU(4, 32, batch_first=True)
            self.head = nn.Linear(32, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h, _ = self.gru(x)
            return self.head(h[:, -1])

    out = workdir / "gru"
    x, y = _sign_sequences()
    torch.manual_seed(0)
    model = GRUClassifier()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    T.train(T.fresh(out), model, opt, T.shuffled(x, y, 64), T.ce, 250)
    return out


def record_encoder_warmup_cosine(workdir: Path) -> Path:
    """A 2-layer pre-norm ``nn.TransformerEncoder`` (4 heads, GELU) classifier on "token 5
    occurs", AdamW 1e-3 with 20 steps of linear warm-up then cosine decay to 0, clip 1.0,
    200 steps."""
    import math

    import torch
    from torch import nn

    from . import torch_training as T

    class Encoder(nn.Module):
        def __init__(self, vocab: int = 32, d: int = 32) -> None:
            super().__init__()
            self.emb = nn.Embedding(vocab, d)
            self.pos = nn.Embedding(16, d)
            layer = nn.TransformerEncoderLayer(d, HEADS, 2 * d, dropout=0.0, activation="gelu",
                                               batch_first=True, norm_first=True)  # fmt: skip
            self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
            self.norm = nn.LayerNorm(d)
            self.head = nn.Linear(d, 2)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            h = self.emb(ids) + self.pos(torch.arange(ids.shape[1]))
            return self.head(self.norm(self.encoder(h))[:, 0])

    out = workdir / "encoder_warmup_cosine"
    x, y = _token_task()
    torch.manual_seed(0)
    model = Encoder()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    steps, warm = 200, 20

    def schedule(t: int) -> None:
        f = (
            (t + 1) / warm
            if t < warm
            else 0.5 * (1 + math.cos(math.pi * (t - warm) / (steps - warm)))
        )
        for g in opt.param_groups:
            g["lr"] = 1e-3 * f

    T.train(T.fresh(out), model, opt, T.shuffled(x, y, 32), T.ce, steps, clip=1.0,
            user={"attention_heads": HEADS}, before_step=schedule)  # fmt: skip
    return out


def record_resnet(workdir: Path) -> Path:
    """A small ResNet (conv stem, 3 basic residual blocks conv-BN-ReLU-conv-BN + identity,
    global pool, linear head) on the template images, SGD momentum 0.9 lr 0.05 with weight
    decay 5e-4, 150 steps."""
    import torch
    from torch import nn

    from . import torch_training as T

    class Block(nn.Module):
        def __init__(self, c: int) -> None:
            super().__init__()
            self.conv1, self.bn1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
            self.conv2, self.bn2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.relu(self.bn1(self.conv1(x)))
            return torch.relu(x + self.bn2(self.conv2(h)))

    class ResNet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stem = nn.Conv2d(1, 16, 3, padding=1)
            self.blocks = nn.Sequential(Block(16), Block(16), Block(16))
            self.head = nn.Linear(16, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.blocks(torch.relu(self.stem(x))).mean((2, 3)))

    out = workdir / "resnet"
    x, y = _images()
    torch.manual_seed(0)
    model = ResNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    T.train(T.fresh(out), model, opt, T.shuffled(x, y, 64), T.ce, 150)
    return out


CASES: list[HealthCase] = [
    HealthCase("mlp_adam", "healthy", "torch", record_mlp_adam,
               "ReLU MLP, Adam, teacher task", max_final_loss=0.3, quick=True),
    HealthCase("mlp_regression_sgd", "healthy", "torch", record_mlp_regression_sgd,
               "tanh MLP regression, SGD momentum", max_final_loss=0.05),
    HealthCase("cnn_bn_sgd", "healthy", "torch", record_cnn_bn_sgd,
               "CNN with BatchNorm, SGD momentum", max_final_loss=0.3),
    HealthCase("lstm", "healthy", "torch", record_lstm,
               "LSTM classifier, Adam", max_final_loss=0.3),
    HealthCase("bert_from_init", "healthy", "torch+transformers", record_bert_from_init,
               "tiny BERT from init, AdamW + clip_grad_norm_(1.0)", max_final_loss=0.3,
               quick=True),
    HealthCase("mha_classifier", "healthy", "torch", record_mha_classifier,
               "hand-written attention classifier (4 heads), AdamW + clip", max_final_loss=0.3),
    HealthCase("gpt2_trainer", "healthy", "torch+transformers", record_gpt2_trainer,
               "tiny GPT-2 from config, HF Trainer (AdamW, clip 1.0)", max_final_loss=0.3),
    HealthCase("bert_finetune", "healthy", "torch+transformers", record_bert_finetune,
               "tiny BERT pretrained, saved, reloaded, fine-tuned", max_final_loss=0.3),
    HealthCase("gpt2_lora", "healthy", "torch+peft", record_gpt2_lora,
               "LoRA fine-tune of a pretrained tiny GPT-2", max_final_loss=0.5),
    HealthCase("nnx_mlp", "healthy", "jax+flax.nnx", record_nnx_mlp,
               "Flax NNX MLP, AdamW", max_final_loss=0.3, quick=True),
    HealthCase("linen_cnn", "healthy", "jax+flax.linen", record_linen_cnn,
               "Flax Linen CNN, SGD momentum", max_final_loss=0.3),
    HealthCase("demo", "healthy", "jax+flax.linen", record_demo,
               "traintape demo (spirals MLP, Adam)", max_final_loss=0.1),
    HealthCase("keras_mlp", "healthy", "keras+tf", record_keras_mlp,
               "Keras MLP, model.fit, Adam", max_final_loss=0.3),
    HealthCase("keras_cnn_bn", "healthy", "keras+tf", record_keras_cnn_bn,
               "Keras CNN with BatchNorm, model.fit, SGD momentum", max_final_loss=0.3),
    HealthCase("gru", "healthy", "torch", record_gru, "GRU classifier, Adam",
               max_final_loss=0.3),
    HealthCase("encoder_warmup_cosine", "healthy", "torch", record_encoder_warmup_cosine,
               "pre-norm nn.TransformerEncoder, AdamW, warm-up + cosine, clip",
               max_final_loss=0.3),
    HealthCase("resnet", "healthy", "torch", record_resnet,
               "small ResNet (BatchNorm, residual blocks), SGD momentum + weight decay",
               max_final_loss=0.3),
]  # fmt: skip
