"""The conformance models in Keras 3 (layer names = canonical layer names), on the
TensorFlow backend (column ``tf``) and, with ``KERAS_BACKEND`` set by the worker, on JAX
(``keras-jax``) and torch (``keras-torch``): the same script on every backend.

Trained with ``model.fit`` and ``traintape.keras.Callback`` (param, grad, update,
activation and, with Adam, opt_state capture; probe activations snapshotted on
full-capture steps).
"""

from __future__ import annotations

import os
from typing import Any

from conformance import spec as S


def _keras(dtype: str) -> Any:
    os.environ.setdefault("TF_DETERMINISTIC_OPS", "1")
    import keras

    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        tf.config.experimental.enable_tensor_float_32_execution(False)
        tf.config.experimental.enable_op_determinism()
    keras.config.set_floatx(dtype)
    keras.utils.set_random_seed(0)
    return keras


def _gelu(keras: Any) -> Any:
    ops = keras.ops

    def gelu(x: Any) -> Any:  # tanh approximation with the conformance constants
        return 0.5 * x * (1.0 + ops.tanh(S.GELU_C * (x + S.GELU_A * x * x * x)))

    return gelu


def build(model_name: str, dtype: str = "float32") -> Any:
    """The Keras functional model ``model_name`` (built, weights not yet loaded)."""
    keras = _keras(dtype)
    L = keras.layers
    if model_name == "mlp":
        x = keras.Input((S.MLP_IN,), dtype=dtype)
        # activations as separate layers: ``fc1/output`` is the Dense output (pre-tanh),
        # as in torch and Flax; a fused ``activation=`` would record it post-tanh
        h = L.Activation("tanh", name="tanh")(L.Dense(S.MLP_HIDDEN, name="fc1")(x))
        out = L.Dense(S.MLP_OUT, name="head")(h)
    elif model_name == "cnn":
        x = keras.Input((S.CNN_HW, S.CNN_HW, S.CNN_C), dtype=dtype)
        h = L.ZeroPadding2D(1, name="pad1")(x)  # explicit symmetric padding 1
        h = L.Conv2D(S.CNN_F1, 3, padding="valid", use_bias=False, name="conv1")(h)
        h = L.BatchNormalization(momentum=S.BN_MOMENTUM_KERAS, epsilon=S.BN_EPS, name="bn1")(h)
        h = L.ReLU(name="relu1")(h)
        h = L.AveragePooling2D(2, name="pool1")(h)
        h = L.GlobalAveragePooling2D(name="gap")(h)
        out = L.Dense(S.CNN_OUT, name="head")(h)
    elif model_name == "transformer":
        x = keras.Input((S.TF_T,), dtype="int32")
        e = L.Embedding(S.TF_VOCAB, S.TF_D, name="emb")(x)
        h = L.LayerNormalization(epsilon=S.LN_EPS, name="ln1")(e)
        a = L.MultiHeadAttention(S.TF_HEADS, S.TF_D // S.TF_HEADS, use_bias=False, name="attn")(
            h, h, h
        )
        r = L.Add(name="res1")([e, a])
        h = L.LayerNormalization(epsilon=S.LN_EPS, name="ln2")(r)
        h = L.Dense(S.TF_FF, name="fc1")(h)
        h = L.Activation(_gelu(keras), name="gelu")(h)
        h = L.Dense(S.TF_D, name="fc2")(h)
        r = L.Add(name="res2")([r, h])
        out = L.Dense(S.TF_OUT, name="head")(L.GlobalAveragePooling1D(name="mean")(r))
    elif model_name == "gru":
        x = keras.Input((S.GRU_T, S.GRU_IN), dtype=dtype)
        seq = L.GRU(S.GRU_H, return_sequences=True, reset_after=True, name="gru")(x)
        last = L.Lambda(lambda s: s[:, -1], name="last")(seq)
        out = L.Dense(S.GRU_OUT, name="head")(last)
    elif model_name == "llm":
        x = keras.Input((S.LLM_T,), dtype="int32")
        e = L.Embedding(S.LLM_VOCAB, S.LLM_D, name="embed")(x)
        h = L.RMSNormalization(epsilon=S.RMS_EPS, name="attn_norm")(e)
        r = L.Add(name="res1")([e, _llm_layers(keras, "attn")(h)])
        h = L.RMSNormalization(epsilon=S.RMS_EPS, name="mlp_norm")(r)
        r = L.Add(name="res2")([r, _llm_layers(keras, "mlp")(h)])
        h = L.RMSNormalization(epsilon=S.RMS_EPS, name="norm")(r)
        out = L.Dense(S.LLM_VOCAB, use_bias=False, name="lm_head")(h)
    else:
        raise KeyError(model_name)
    return keras.Model(x, out, name=model_name)


def _llm_layers(keras: Any, which: str) -> Any:
    """The ``llm`` block's causal self-attention (separate bias-free q/k/v/o ``Dense``
    sub-layers: ``attn/q/kernel``...; rotary q and k) or SwiGLU MLP (``mlp/gate``, ``mlp/up``,
    ``mlp/down``), written out with ``keras.ops`` like the other frameworks."""
    ops, L = keras.ops, keras.layers

    def dense(n: int, name: str) -> Any:
        return L.Dense(n, use_bias=False, name=name)

    class CausalSelfAttention(keras.layers.Layer):
        def __init__(self, **kw: Any) -> None:
            super().__init__(**kw)
            self.q, self.k, self.v, self.o = (dense(S.LLM_D, p) for p in "qkvo")

        def call(self, x: Any) -> Any:
            t, heads = S.LLM_T, S.LLM_HEADS
            dh = S.LLM_D // heads

            def split(y: Any) -> Any:
                return ops.reshape(y, (-1, t, heads, dh))

            cos, sin = (
                ops.convert_to_tensor(a[:, None, :])
                for a in S.rope_tables(keras.backend.standardize_dtype(x.dtype))
            )
            half = dh // 2

            def rope(y: Any) -> Any:  # Llama's rotate_half convention
                return y * cos + ops.concatenate([-y[..., half:], y[..., :half]], axis=-1) * sin

            q = rope(split(self.q(x))) / ops.cast(ops.sqrt(float(dh)), x.dtype)
            logits = ops.einsum("bqhd,bkhd->bhqk", q, rope(split(self.k(x))))
            mask = ops.tril(ops.ones((t, t), dtype="bool"))
            logits = ops.where(mask, logits, ops.cast(float("-inf"), logits.dtype))
            w = ops.softmax(logits, axis=-1)
            a = ops.reshape(ops.einsum("bhqk,bkhd->bqhd", w, split(self.v(x))), (-1, t, S.LLM_D))
            return self.o(a)

    class SwiGLU(keras.layers.Layer):
        def __init__(self, **kw: Any) -> None:
            super().__init__(**kw)
            self.gate = dense(S.LLM_FF, "gate")
            self.up = dense(S.LLM_FF, "up")
            self.down = dense(S.LLM_D, "down")

        def call(self, x: Any) -> Any:
            g = self.gate(x)
            return self.down(g * ops.sigmoid(g) * self.up(x))

    return {"attn": CausalSelfAttention, "mlp": SwiGLU}[which](name=which)


def _adam(keras: Any) -> Any:
    """``keras.optimizers.Adam`` with torch/optax's ε placement.

    Keras adds its ε to the *uncorrected* √v: θ −= lr·√(1−β₂ᵗ)/(1−β₁ᵗ) · m/(√v + ε_K);
    torch and optax to the bias-corrected √v̂ = √v/√(1−β₂ᵗ): θ −= lr·m̂/(√v̂ + ε), which
    is the same expression with ε_K = ε·√(1−β₂ᵗ). No constant ε_K matches every step, so
    step t runs Keras's own ``update_step`` (moments, bias correction and all) with
    ε_K(t) = :func:`conformance.spec.keras_adam_epsilon` (t = 1, 2, ...: Keras's
    ``iterations + 1``).

    The embedding's gradient (``tf.IndexedSlices``, one row per token occurrence) is made
    dense first: Keras squares the rows before summing them, so a token seen k times in
    a batch adds Σ gᵢ² to ``v`` instead of (Σ gᵢ)²; torch and optax take the dense
    gradient. SGD with momentum is linear in g, so it needs none.
    """
    ops = keras.ops
    dense = keras.backend.backend() == "tensorflow"  # other backends' gradients are dense

    class TorchEpsilonAdam(keras.optimizers.Adam):
        def update_step(self, gradient: Any, variable: Any, learning_rate: Any) -> None:
            if dense:
                import tensorflow as tf

                gradient = tf.convert_to_tensor(gradient)  # IndexedSlices -> dense
            eps: Any = self.epsilon
            t = ops.cast(self.iterations + 1, variable.dtype)
            self.epsilon = S.keras_adam_epsilon(t, ops)
            try:
                super().update_step(gradient, variable, learning_rate)
            finally:
                self.epsilon = eps

    return TorchEpsilonAdam(S.ADAM_LR, beta_1=S.ADAM_B1, beta_2=S.ADAM_B2, epsilon=S.ADAM_EPS)


def _optimizer(keras: Any, name: str) -> Any:
    if name == "sgd":
        return keras.optimizers.SGD(learning_rate=S.LR, momentum=S.MOMENTUM)
    if name == "adam":
        return _adam(keras)
    raise ValueError(name)


def train(
    model_name: str, url: str, dtype: str, steps: int = S.STEPS, optimizer: str = "sgd"
) -> None:
    """Train ``model_name`` for ``steps`` steps of ``optimizer`` (SGD with momentum or
    Adam) with ``fit``, recording."""
    keras = _keras(dtype)
    import traintape.keras as ttk
    from conformance.policy import recorder

    model = build(model_name, dtype)
    ttk.from_canonical(model, S.initial_weights(model_name, dtype), strict=True)
    x, y = S.batches(model_name, dtype)
    model.compile(
        optimizer=_optimizer(keras, optimizer),
        loss="mse",
    )
    probe = S.probe(model_name, dtype)
    with recorder(url, model_name, optimizer) as rec:
        cb = ttk.Callback(rec, probe=probe, metrics=False)
        model.fit(
            x[:steps].reshape(-1, *x.shape[2:]),
            y[:steps].reshape(-1, *y.shape[2:]),
            batch_size=S.BATCH,
            epochs=1,
            shuffle=False,
            verbose=0,
            callbacks=[cb],
        )
