"""A user's training script, run by tests/test_resume_and_kinds.py as a subprocess.

argv: framework (jax | torch) phase url
- ``first``: record steps 0..21, commit (``rec.flush()``), then SIGKILL itself (no close);
- ``resume``: ``traintape.Recorder(url, resume_step=15)`` and the adapters exactly as the
  README shows them (no start step anywhere); train steps 15..21, ``close()``. Every
  warning raised is printed as ``WARNING: <category>: <message>``;
- ``kinds``: a new store, the default policy, ``watch(..., kinds=("update", "opt_state"))``.
Prints ``steps: [...]`` of the store it wrote (resume, kinds).
"""

import os
import signal
import sys
import warnings

framework, phase, url = sys.argv[1:4]
warnings.simplefilter("always")
caught = warnings.catch_warnings(record=True)
log = caught.__enter__()

import traintape  # noqa: E402

if framework == "jax":
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import optax

    import traintape.jax as tj

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(2)(nn.relu(nn.Dense(8)(x)))

    model = MLP()
    params = model.init(jax.random.key(0), jnp.ones((4, 3)))

    def loss_fn(params, x, y):
        return jnp.mean((model.apply(params, x) - y) ** 2)

    def batch(t):
        x = jax.random.normal(jax.random.key(t), (4, 3))
        return x, jnp.tanh(x[:, :2])

    def train(rec, steps, kinds=None):
        vg = tj.value_and_grad(loss_fn, recorder=rec)
        opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
        tx = tj.watch(opt, rec) if kinds is None else tj.watch(opt, rec, kinds=kinds)

        @jax.jit
        def step(params, opt_state, x, y):
            loss, grads = vg(params, x, y)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        p, o = params, tx.init(params)
        for t in steps:
            p, o, loss = step(p, o, *batch(t))
            rec.log(t, loss=float(loss))
else:
    import torch

    import traintape.torch as tt

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))

    def train(rec, steps, kinds=None):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        kw = {} if kinds is None else {"kinds": kinds}
        with tt.watch(model, rec, optimizer=opt, **kw):
            for t in steps:
                g = torch.Generator().manual_seed(t)
                x = torch.randn(4, 3, generator=g)
                loss = ((model(x) - torch.tanh(x[:, :2])) ** 2).mean()
                opt.zero_grad()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                rec.log(t, loss=float(loss))


if phase == "first":
    rec = traintape.Recorder(url)
    train(rec, range(22))
    rec.flush()
    os.kill(os.getpid(), signal.SIGKILL)
elif phase == "resume":
    rec = traintape.Recorder(url, resume_step=15)
    train(rec, range(15, 22))
    rec.close()
elif phase == "kinds":
    rec = traintape.Recorder(url)
    train(rec, range(3), kinds=("update", "opt_state"))
    rec.close()
caught.__exit__(None, None, None)
for w in log:
    print(f"WARNING: {w.category.__name__}: {w.message}")
run = traintape.open_run(url)
print("steps:", run.steps.tolist())
print("kinds:", sorted(str(k) for k in run.kinds()))
