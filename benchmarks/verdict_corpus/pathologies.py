"""Planted pathologies of the health corpus: the trainings of :mod:`.healthy` (or their
like) with one mistake people make. Each case says which issue concept(s) of
:data:`~verdict_corpus.health_case.ISSUE_TYPES` must be found, and on which layer(s).

Every ``record_*`` function trains for real, records with a traintape adapter into
``workdir/<case name>`` and returns that path.
"""

from __future__ import annotations

from pathlib import Path

from .health_case import HealthCase


class NotPlanted(RuntimeError):
    """The planted pathology did not take (a corpus bug, not a verdict): raised by a case
    whose training, measured with the framework's own numbers, does not show it."""


def _confirm(ok: bool, what: str) -> None:
    if not ok:
        raise NotPlanted(what)


# ---------------------------------------------------------------- torch MLPs


def record_vanishing_deep_sigmoid(workdir: Path) -> Path:
    """A 10-layer sigmoid MLP (default init), SGD lr 0.1: the gradient reaching the first
    layers is orders of magnitude below the last one's (sigmoid' <= 1/4 per layer)."""
    import torch
    from torch import nn

    from . import torch_training as T

    out = workdir / "vanishing_deep_sigmoid"
    x, y = T.teacher_task(16, 4)
    model = T.mlp([16] + [32] * 9 + [4], act=nn.Sigmoid)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    T.train(T.fresh(out), model, opt, T.shuffled(x, y, 64), T.ce, 120)
    first, last = model[0].weight.grad.norm(), model[-1].weight.grad.norm()
    _confirm(bool(first < 1e-2 * last), f"first/last layer grad norm {first / last:.3g}")
    return out


def record_exploding_lr(workdir: Path) -> Path:
    """The healthy ``mlp_regression_sgd`` run with lr 5.0 (100x its 0.05): the weights
    and gradients grow geometrically until they overflow."""
    import torch
    from torch import nn

    from . import torch_training as T

    out = workdir / "exploding_lr"
    x, y = T.teacher_regression(16, 4)
    model = T.mlp([16, 64, 64, 4], act=nn.Tanh)
    opt = torch.optim.SGD(model.parameters(), lr=5.0, momentum=0.9)
    losses = T.train(T.fresh(out), model, opt, T.shuffled(x, y, 64), T.mse, 80)
    _confirm(not max(losses) < 1e6, f"the loss stayed below 1e6 (max {max(losses):.3g})")
    return out


def record_dead_relu(workdir: Path) -> Path:
    """The ``mlp_adam`` MLP whose second hidden layer's bias starts at -10 (a bad bias
    init): its ReLUs never fire, layer ``2`` gets exactly zero gradient and so does
    everything before it; only the head learns (the bias)."""
    import torch

    from . import torch_training as T

    out = workdir / "dead_relu"
    x, y = T.teacher_task(16, 4)
    model = T.mlp([16, 64, 64, 4])
    with torch.no_grad():
        model[2].bias.fill_(-10.0)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    T.train(T.fresh(out), model, opt, T.shuffled(x, y, 64), T.ce, 150)
    with torch.no_grad():
        alive = float((model[2](model[1](model[0](x))) > 0).float().mean())
    _confirm(alive < 0.01, f"{alive:.1%} of layer 2's ReLUs fire")
    return out


def record_zero_grad_forgotten(workdir: Path) -> Path:
    """The ``mlp_adam`` MLP trained with SGD lr 0.02 momentum 0.9 and no
    ``opt.zero_grad()``: ``p.grad`` is the sum of every gradient so far, so the step
    grows with t (issue 24: health said "healthy")."""
    import torch

    from . import torch_training as T

    out = workdir / "zero_grad_forgotten"
    x, y = T.teacher_task(16, 4)
    model = T.mlp([16, 64, 64, 4])
    opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    batch = T.shuffled(x, y, 64)
    T.train(T.fresh(out), model, opt, batch, T.ce, 150, zero_grad=False)
    held = model[0].weight.grad.norm()
    model.zero_grad()
    T.ce(model, *batch(150)).backward()
    fresh_norm = model[0].weight.grad.norm()
    _confirm(bool(held > 10 * fresh_norm), f"p.grad only {held / fresh_norm:.3g}x one step's")
    return out


def record_frozen_left_out_of_optimizer(workdir: Path) -> Path:
    """The ``mlp_adam`` MLP whose optimizer was built from the first and last layers only
    (a parameter group forgotten): layer ``2`` gets gradients but never moves."""
    import torch

    from . import torch_training as T

    out = workdir / "frozen_left_out_of_optimizer"
    x, y = T.teacher_task(16, 4)
    model = T.mlp([16, 64, 64, 4])
    opt = torch.optim.Adam([*model[0].parameters(), *model[4].parameters()], lr=3e-3)
    init = model[2].weight.detach().clone()
    T.train(T.fresh(out), model, opt, T.shuffled(x, y, 64), T.ce, 200)
    _confirm(torch.equal(init, model[2].weight), "layer 2 moved")
    return out


def record_frozen_requires_grad(workdir: Path) -> Path:
    """The ``mlp_adam`` MLP trained from scratch with its hidden layer ``2`` frozen by
    mistake (``requires_grad_(False)`` meant for a pretrained part, applied to a layer of
    a fresh model): layer ``2`` stays at its random init."""
    import torch

    from . import torch_training as T

    out = workdir / "frozen_requires_grad"
    x, y = T.teacher_task(16, 4)
    model = T.mlp([16, 64, 64, 4])
    model[2].requires_grad_(False)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    init = model[2].weight.detach().clone()
    T.train(T.fresh(out), model, opt, T.shuffled(x, y, 64), T.ce, 200)
    _confirm(torch.equal(init, model[2].weight), "layer 2 moved")
    return out


def record_lr_too_small(workdir: Path) -> Path:
    """The ``mlp_adam`` run at Adam lr 3e-7 (1e4x too small): the loss does not move."""
    import torch

    from . import torch_training as T

    out = workdir / "lr_too_small"
    x, y = T.teacher_task(16, 4)
    model = T.mlp([16, 64, 64, 4])
    opt = torch.optim.Adam(model.parameters(), lr=3e-7)
    losses = T.train(T.fresh(out), model, opt, T.shuffled(x, y, 64), T.ce, 200)
    a, b = sum(losses[:20]) / 20, sum(losses[-20:]) / 20
    _confirm(abs(a - b) < 0.01 * a, f"the loss moved from {a:.4g} to {b:.4g}")
    return out


def record_batchnorm_eval(workdir: Path) -> Path:
    """The healthy ``cnn_bn_sgd`` CNN trained while in ``eval()`` mode (``model.eval()``
    for a validation pass, ``model.train()`` forgotten): BatchNorm normalises with its
    initial running statistics (0, 1), which never update."""
    import torch

    from . import torch_training as T
    from .healthy import _images, cnn

    out = workdir / "batchnorm_eval"
    x, y = _images()
    model = cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    T.train(T.fresh(out), model, opt, T.shuffled(x, y, 64), T.ce, 200, train_mode=False)
    for bn in (model[1], model[5]):
        _confirm(bool((bn.running_mean == 0).all() and (bn.running_var == 1).all()),
                 "BatchNorm running statistics moved")  # fmt: skip
    return out


def record_lstm_forget_closed(workdir: Path) -> Path:
    """The healthy ``lstm`` classifier with its forget-gate bias initialised to -10
    (``bias_ih + bias_hh``; a sign error in a "forget bias" init): the cell state is
    wiped at every step, so the sum over 10 steps cannot be integrated."""
    import torch

    from . import torch_training as T
    from .healthy import _LSTMClassifier, _sign_sequences

    out = workdir / "lstm_forget_closed"
    x, y = _sign_sequences()
    model = _LSTMClassifier.build(forget_bias=-10.0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    T.train(T.fresh(out), model, opt, T.shuffled(x, y, 64), T.ce, 250)
    b_f = (model.lstm.bias_ih_l0 + model.lstm.bias_hh_l0).detach()[32:64].median()
    _confirm(bool(b_f < -6), f"the forget bias reopened to {float(b_f):.3g}")
    return out


def _head0_qk_scaled(workdir: Path, name: str, scale: float) -> Path:
    """The healthy ``mha_classifier`` with head 0's query and key rows of the fused
    ``in_proj_weight`` multiplied by ``scale`` at init (a bad custom init)."""
    import torch

    from . import torch_training as T
    from .healthy import HEADS, _token_task, mha_classifier

    out = workdir / name
    x, y = _token_task()
    model = mha_classifier()
    d = model.attn.embed_dim
    hd = d // HEADS
    with torch.no_grad():
        w = model.attn.in_proj_weight
        w[0:hd] *= scale  # q rows of head 0
        w[d : d + hd] *= scale  # k rows of head 0
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    T.train(T.fresh(out), model, opt, T.shuffled(x, y, 32), T.ce, 200, clip=1.0,
            user={"attention_heads": HEADS})  # fmt: skip
    with torch.no_grad():  # head 0's attention on the pool: one-hot (scaled) or uniform (0)
        h = model.emb(x[:256]) + model.pos(torch.arange(x.shape[1]))
        _, w = model.attn(h, h, h, need_weights=True, average_attn_weights=False)
        peak = float(w[:, 0].max(-1).values.mean())
    want = peak > 0.95 if scale > 1 else abs(peak - 1 / x.shape[1]) < 1e-6
    _confirm(want, f"head 0's mean peak attention weight is {peak:.3g}")
    return out


def record_attention_head_collapsed(workdir: Path) -> Path:
    """Head 0's q and k scaled by 30 (logits ×900): its softmax is one-hot, so its q and k
    get almost no gradient (and never recover)."""
    return _head0_qk_scaled(workdir, "attention_head_collapsed", 30.0)


def record_attention_head_zero_qk(workdir: Path) -> Path:
    """Head 0's q and k initialised to zero: its attention is uniform, and the gradient
    of its q (∝ k) and k (∝ q) is exactly zero forever — a head that never learns."""
    return _head0_qk_scaled(workdir, "attention_head_zero_qk", 0.0)


def record_loss_nan(workdir: Path) -> Path:
    """The healthy ``mlp_regression_sgd`` run where batch 60 holds a corrupted example
    (a NaN feature): the loss is NaN at step 60, and so is everything after."""
    import torch
    from torch import nn

    from . import torch_training as T

    out = workdir / "loss_nan"
    x, y = T.teacher_regression(16, 4)
    model = T.mlp([16, 64, 64, 4], act=nn.Tanh)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    clean = T.shuffled(x, y, 64)

    def batch(t: int) -> T.Batch:
        xb, yb = clean(t)
        if t == 60:
            xb = xb.clone()
            xb[3, 5] = float("nan")
        return xb, yb

    losses = T.train(T.fresh(out), model, opt, batch, T.mse, 100)
    _confirm(losses[59] == losses[59] and losses[60] != losses[60], "no NaN loss at step 60")
    return out


def record_unshuffled(workdir: Path) -> Path:
    """The ``mlp_adam`` run on a pool stored class by class and read in order
    (``shuffle=False``): each stretch of 8 batches holds one class, the loss cycles with
    a period of one epoch (32 batches) and never settles."""
    import numpy as np
    import torch

    from . import torch_training as T

    out = workdir / "unshuffled"
    x, y = T.teacher_task(16, 4)
    model = T.mlp([16, 64, 64, 4])
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = np.array(T.train(T.fresh(out), model, opt, T.in_order(x, y, 64), T.ce, 300))
    tail = losses[100:]
    ac = float(np.corrcoef(tail[:-32], tail[32:])[0, 1])
    _confirm(ac > 0.8, f"loss autocorrelation at one epoch (32 steps) only {ac:.2f}")
    return out


# ---------------------------------------------------------------- Keras


def record_saturated_tanh(workdir: Path) -> Path:
    """A Keras MLP with ``Dense(64, activation="tanh")`` layers (the recorded layer output
    is the tanh) on inputs left unnormalised (features of scale 30: "forgot to
    standardise"): the first layer's tanh sits at ±1. Adam 1e-3, 4 epochs (128 steps).

    (In torch and Flax the tanh is a separate function or module without parameters,
    whose output the adapters do not record: there a saturated tanh is not visible as
    an activation.)"""
    import keras

    import traintape
    import traintape.keras as tk

    from . import torch_training as T
    from .healthy import _np_teacher

    out = workdir / "saturated_tanh"
    x, y = _np_teacher()
    x = x * 30.0
    keras.utils.set_random_seed(0)
    L = keras.layers
    model = keras.Sequential([keras.Input((16,)), L.Dense(64, activation="tanh", name="fc1"),
                              L.Dense(64, activation="tanh", name="fc2"),
                              L.Dense(4, name="head")])  # fmt: skip
    model.compile(optimizer=keras.optimizers.Adam(1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))  # fmt: skip
    with traintape.Recorder(T.fresh(out), T.policy()) as rec:
        model.fit(x, y, batch_size=64, epochs=4, verbose=0, shuffle=True,
                  callbacks=[tk.Callback(rec)])  # fmt: skip
    sat = float(keras.ops.mean(keras.ops.abs(model.get_layer("fc1")(x[:512]))))
    _confirm(sat > 0.9, f"fc1's mean |tanh| is {sat:.3g}")
    return out


def record_dead_relu_keras(workdir: Path) -> Path:
    """A Keras MLP with ``Dense(64, activation="relu")`` layers (the recorded output is
    the ReLU's) whose second layer's bias is initialised to -10: its units never fire.
    Adam 3e-3, 4 epochs (128 steps)."""
    import keras

    import traintape
    import traintape.keras as tk

    from . import torch_training as T
    from .healthy import _np_teacher

    out = workdir / "dead_relu_keras"
    x, y = _np_teacher()
    keras.utils.set_random_seed(0)
    L = keras.layers
    dead = keras.initializers.Constant(-10.0)
    model = keras.Sequential([keras.Input((16,)), L.Dense(64, activation="relu", name="fc1"),
                              L.Dense(64, activation="relu", bias_initializer=dead, name="fc2"),
                              L.Dense(4, name="head")])  # fmt: skip
    model.compile(optimizer=keras.optimizers.Adam(3e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))  # fmt: skip
    with traintape.Recorder(T.fresh(out), T.policy()) as rec:
        model.fit(x, y, batch_size=64, epochs=4, verbose=0, shuffle=True,
                  callbacks=[tk.Callback(rec)])  # fmt: skip
    h = model.get_layer("fc2")(model.get_layer("fc1")(x[:512]))
    zero = float(keras.ops.mean(keras.ops.cast(h == 0, "float32")))
    _confirm(zero > 0.99, f"only {zero:.1%} of fc2's outputs are 0")
    return out


# ---------------------------------------------------------------- Flax Linen


def record_vanishing_linen_sigmoid(workdir: Path) -> Path:
    """A Flax Linen MLP of 10 sigmoid ``Dense`` layers (``layers_0`` … ``layers_9``), optax
    SGD lr 0.1, 120 steps, under ``traintape.jax.value_and_grad`` + ``watch``."""
    import flax.linen as nn
    import jax
    import optax

    import traintape
    import traintape.jax as tj

    from . import torch_training as T
    from .healthy import _batches, _np_teacher

    class Deep(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            for i in range(9):
                x = nn.sigmoid(nn.Dense(32, name=f"layers_{i}")(x))
            return nn.Dense(4, name="layers_9")(x)

    out = workdir / "vanishing_linen_sigmoid"
    x, y = _np_teacher()
    model = Deep()
    params = model.init(jax.random.key(0), x[:1])
    with traintape.Recorder(T.fresh(out), T.policy()) as rec:

        def loss_fn(p, xb, yb):
            return optax.softmax_cross_entropy_with_integer_labels(model.apply(p, xb), yb).mean()

        vg = tj.value_and_grad(loss_fn, recorder=rec)
        tx = tj.watch(optax.sgd(0.1), rec)
        state = tx.init(params)

        @jax.jit
        def step(p, s, xb, yb):
            loss, g = vg(p, xb, yb)
            u, s = tx.update(g, s, p)
            return optax.apply_updates(p, u), s, loss

        for t, idx in enumerate(_batches(len(y), 64, 120)):
            params, state, loss = step(params, state, x[idx], y[idx])
            rec.log(t, loss=float(loss))
    return out


def record_zero_grad_forgotten_adam(workdir: Path) -> Path:
    """The healthy ``mlp_adam`` run (Adam 3e-3) without ``opt.zero_grad()``: Adam
    normalises the growing sum, so the steps do not grow, but they follow the sum of all
    past gradients and the loss swings (0.4 → 7 → 0.8 …)."""
    import torch

    from . import torch_training as T

    out = workdir / "zero_grad_forgotten_adam"
    x, y = T.teacher_task(16, 4)
    model = T.mlp([16, 64, 64, 4])
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    batch = T.shuffled(x, y, 64)
    T.train(T.fresh(out), model, opt, batch, T.ce, 200, zero_grad=False)
    held = model[0].weight.grad.norm()
    model.zero_grad()
    T.ce(model, *batch(200)).backward()
    fresh_norm = model[0].weight.grad.norm()
    _confirm(bool(held > 10 * fresh_norm), f"p.grad only {held / fresh_norm:.3g}x one step's")
    return out


def record_lr_too_small_sgd(workdir: Path) -> Path:
    """The healthy ``mlp_regression_sgd`` run at lr 1e-5 (5000x too small): the loss
    stays where it started."""
    import torch
    from torch import nn

    from . import torch_training as T

    out = workdir / "lr_too_small_sgd"
    x, y = T.teacher_regression(16, 4)
    model = T.mlp([16, 64, 64, 4], act=nn.Tanh)
    opt = torch.optim.SGD(model.parameters(), lr=1e-5, momentum=0.9)
    losses = T.train(T.fresh(out), model, opt, T.shuffled(x, y, 64), T.mse, 200)
    a, b = sum(losses[:40]) / 40, sum(losses[-40:]) / 40
    _confirm(abs(a - b) < 0.03 * a, f"the loss moved from {a:.4g} to {b:.4g}")
    return out


def record_lr_100x_gpt2_adam(workdir: Path) -> Path:
    """The tiny GPT-2 of the healthy ``gpt2_lora`` pretraining trained with AdamW at lr 0.3
    (100x its 3e-3), no clipping: each step moves the weights by more than their size
    and the model collapses to predicting the uniform distribution (loss ≈ ln 32)."""
    import torch

    from . import torch_training as T
    from .healthy import _lm_loss, _shift_sequences, tiny_gpt2

    out = workdir / "lr_100x_gpt2_adam"
    model = tiny_gpt2()
    ids = _shift_sequences()
    opt = torch.optim.AdamW(model.parameters(), lr=0.3)
    losses = T.train(T.fresh(out), model, opt, T.shuffled(ids, ids[:, 0], 16), _lm_loss, 100,
                     user={"attention_heads": 2})  # fmt: skip
    tail = sum(losses[-10:]) / 10
    _confirm(tail > 3.0, f"the loss came down to {tail:.3g}")
    return out


CASES: list[HealthCase] = [
    HealthCase("vanishing_deep_sigmoid", "pathology", "torch", record_vanishing_deep_sigmoid,
               "10-layer sigmoid MLP", expect=("vanishing",), layers=("0", "2", "4"),
               quick=True),
    HealthCase("exploding_lr", "pathology", "torch", record_exploding_lr,
               "SGD lr 100x too large", expect=("exploding",), quick=True),
    HealthCase("dead_relu", "pathology", "torch", record_dead_relu,
               "hidden bias init -10: ReLUs never fire", expect=("dead",), layers=("2",)),
    HealthCase("zero_grad_forgotten", "pathology", "torch", record_zero_grad_forgotten,
               "opt.zero_grad() forgotten", expect=("accumulating_grad",), quick=True),
    HealthCase("frozen_left_out_of_optimizer", "pathology", "torch",
               record_frozen_left_out_of_optimizer, "layer 2 missing from the optimizer",
               expect=("not_updated",), layers=("2",), quick=True),
    HealthCase("frozen_requires_grad", "pathology", "torch", record_frozen_requires_grad,
               "layer 2 of a fresh model frozen by mistake", expect=("not_updated",),
               layers=("2",)),
    HealthCase("lr_too_small", "pathology", "torch", record_lr_too_small,
               "Adam lr 3e-7", expect=("lr_too_small",)),
    HealthCase("batchnorm_eval", "pathology", "torch", record_batchnorm_eval,
               "CNN trained in eval() mode", expect=("norm_stats_frozen",), layers=("1", "5")),
    HealthCase("lstm_forget_closed", "pathology", "torch", record_lstm_forget_closed,
               "LSTM forget-gate bias -10", expect=("forget_gate_closed",), layers=("lstm",),
               quick=True),
    HealthCase("attention_head_collapsed", "pathology", "torch",
               record_attention_head_collapsed, "head 0 q/k scaled 30x: one-hot softmax",
               expect=("head_collapsed",), layers=("attn",)),
    HealthCase("attention_head_zero_qk", "pathology", "torch", record_attention_head_zero_qk,
               "head 0 q/k zero: uniform attention, no q/k gradient",
               expect=("head_collapsed",), layers=("attn",)),
    HealthCase("saturated_tanh", "pathology", "keras+tf", record_saturated_tanh,
               "tanh MLP on unnormalised inputs (x30)", expect=("saturated",),
               layers=("fc1",)),
    HealthCase("loss_nan", "pathology", "torch", record_loss_nan,
               "NaN feature in batch 60", expect=("nonfinite",), step=60, quick=True),
    HealthCase("unshuffled", "pathology", "torch", record_unshuffled,
               "data read class by class, never shuffled", expect=("periodic_loss",)),
    HealthCase("dead_relu_keras", "pathology", "keras+tf", record_dead_relu_keras,
               "Keras ReLU layer with bias init -10", expect=("dead",), layers=("fc2",)),
    HealthCase("vanishing_linen_sigmoid", "pathology", "jax+flax.linen",
               record_vanishing_linen_sigmoid, "10-layer sigmoid Linen MLP",
               expect=("vanishing",), layers=("layers/0", "layers/1", "layers/2")),
    HealthCase("zero_grad_forgotten_adam", "pathology", "torch",
               record_zero_grad_forgotten_adam, "opt.zero_grad() forgotten under Adam",
               expect=("accumulating_grad",)),
    HealthCase("lr_too_small_sgd", "pathology", "torch", record_lr_too_small_sgd,
               "SGD lr 1e-5 on the regression", expect=("lr_too_small",)),
    HealthCase("lr_100x_gpt2_adam", "pathology", "torch+transformers", record_lr_100x_gpt2_adam,
               "tiny GPT-2, AdamW lr 0.3 (100x), no clipping", expect=("exploding",)),
]  # fmt: skip
