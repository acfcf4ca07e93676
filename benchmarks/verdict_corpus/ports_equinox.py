"""The compare corpus's MLP in Equinox (the third framework of the ``mlp`` ports),
trained with optax the way equinox code does: the model maps one example, training runs
``jax.vmap(model)`` over the batch under ``eqx.filter_jit``, recorded with
``traintape.jax.filter_value_and_grad`` and ``traintape.jax.watch(tx)``.

Weights in: ``conformance.models_equinox.load`` (the adapter's canonical mapping
inverted: ``Linear.weight`` (out, in) = kernel.T).
"""

from __future__ import annotations

from typing import Any

from verdict_corpus import arch as A
from verdict_corpus.ports_jax import _policy, _x64, loss_fn, make_tx


def train_mlp(
    url: str, dtype: str, recipe_name: str, shapes: dict[str, tuple[int, ...]],
    steps: int = A.STEPS,
) -> None:  # fmt: skip
    """Train the equinox MLP (fc1 → ReLU → dropout(0) → fc2 → ReLU → dropout(0) → head)."""
    with _x64(dtype):
        import equinox as eqx
        import jax
        import jax.numpy as jnp

        import traintape
        import traintape.jax as ttj
        from conformance.models_equinox import load

        dt = jnp.dtype(dtype)
        k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)

        class MLP(eqx.Module):
            fc1: eqx.nn.Linear
            drop1: eqx.nn.Dropout
            fc2: eqx.nn.Linear
            drop2: eqx.nn.Dropout
            head: eqx.nn.Linear

            def __init__(self) -> None:
                self.fc1 = eqx.nn.Linear(A.MLP_IN, A.MLP_HIDDEN, key=k1, dtype=dt)
                self.drop1 = eqx.nn.Dropout(0.0)  # the config's hidden_dropout
                self.fc2 = eqx.nn.Linear(A.MLP_HIDDEN, A.MLP_HIDDEN, key=k2, dtype=dt)
                self.drop2 = eqx.nn.Dropout(0.0)
                self.head = eqx.nn.Linear(A.MLP_HIDDEN, A.N_CLASSES, key=k3, dtype=dt)

            def __call__(self, x: Any) -> Any:
                h = self.drop1(jax.nn.relu(self.fc1(x)), inference=True)
                return self.head(self.drop2(jax.nn.relu(self.fc2(h)), inference=True))

        model = load(MLP(), A.initial_weights("mlp", shapes, dtype))
        x, y = A.batches("mlp", dtype, steps)
        with traintape.Recorder(url, policy=_policy(recipe_name)) as rec:
            tx = ttj.watch(make_tx(recipe_name), rec)
            vg = ttj.filter_value_and_grad(
                lambda m, xb, yb: loss_fn("mlp", jax.vmap(m)(xb), yb), recorder=rec
            )

            @eqx.filter_jit
            def step(m: Any, o: Any, xb: Any, yb: Any) -> Any:
                loss, g = vg(m, xb, yb)
                u, o = tx.update(g, o, eqx.filter(m, eqx.is_inexact_array))
                return eqx.apply_updates(m, u), o, loss

            opt_state = tx.init(eqx.filter(model, eqx.is_inexact_array))
            for t in range(steps):
                model, opt_state, loss = step(model, opt_state, x[t], y[t])
                rec.log(t, {"train/loss": float(loss)})
            jax.block_until_ready(eqx.filter(model, eqx.is_array))
