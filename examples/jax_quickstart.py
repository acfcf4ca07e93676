"""JAX quick start: wrap the loss, wrap the optimizer, train as usual.

python examples/jax_quickstart.py && traintape show runs/jax_quickstart
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

import traintape
import traintape.jax as tj


def loss_fn(params: dict, x: jax.Array, y: jax.Array) -> jax.Array:
    h = jnp.tanh(x @ params["hidden"]["kernel"] + params["hidden"]["bias"])
    return jnp.mean((h @ params["out"]["kernel"] - y) ** 2)


def main(out: str = "runs/jax_quickstart", steps: int = 200) -> None:
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    params = {
        "hidden": {"kernel": jax.random.normal(k1, (8, 32)) * 0.3, "bias": jnp.zeros(32)},
        "out": {"kernel": jax.random.normal(k2, (32, 1)) * 0.3},
    }
    x = jax.random.normal(k3, (256, 8))
    y = jnp.sin(x.sum(axis=1, keepdims=True))

    rec = traintape.Recorder(out, traintape.CapturePolicy(full_every=50))
    grad_fn = tj.value_and_grad(loss_fn, recorder=rec)  # records param + grad
    tx = tj.watch(optax.adam(1e-2), rec)  # records update = θ_{t+1} − θ_t
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, x, y):
        loss, grads = grad_fn(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    for t in range(steps):
        params, opt_state, loss = step(params, opt_state, x, y)
        rec.log(t, loss=float(loss))
    rec.close()  # waits for every step's callback, then commits
    print(f"final loss {float(loss):.4f}; recorded into {out}")


if __name__ == "__main__":
    main()
