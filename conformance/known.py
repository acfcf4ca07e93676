"""Known, reported adapter gaps that make conformance cells differ.

Each entry names the adapter, what differs and why; ``tests/test_conformance.py``
turns the affected cells into *strict* xfails, so fixing the adapter makes the test
XPASS (and fail) until the entry is deleted here. Keep this list empty when you can.
"""

from __future__ import annotations

from dataclasses import dataclass

JAX = ("jax-linen", "jax-nnx")


@dataclass(frozen=True)
class Gap:
    frameworks: tuple[str, ...]
    models: tuple[str, ...] | None
    """None: every model."""
    dtypes: tuple[str, ...]
    reason: str
    within: bool = False
    """True: also cells between two of ``frameworks`` differ (e.g. the worker fails)."""


KNOWN_GAPS: tuple[Gap, ...] = (
    Gap(
        JAX,
        ("cnn",),
        ("float32", "float64"),
        reason=(
            "JAX adapter: Flax BatchNorm batch_stats are not recorded as param "
            "bn1/running_mean, bn1/running_var (torch and Keras record them); and "
            "traintape.jax.watch declares update specs without the layer_kind value_and_grad "
            "gives param/grad (update bn1/scale: layer_kind None vs batch_norm)"
        ),
    ),
    Gap(
        JAX,
        ("transformer",),
        ("float32", "float64"),
        reason=(
            "JAX adapter: an attention module built from Dense q/k/v/o sub-modules records "
            "activations attn/{q,k,v,o}/output and no attn/output (torch and Keras: "
            "attn/output only); update specs of LayerNorm lack layer_kind (None vs layer_norm)"
        ),
    ),
    Gap(
        JAX,
        ("gru",),
        ("float32", "float64"),
        reason=(
            "JAX adapter: a GRU written as a module owning kernel_ih/kernel_hh/bias_ih/bias_hh "
            "gets layer_kind None (torch and Keras: gru) and there is no public way to pass "
            "layer kinds to value_and_grad/watch"
        ),
    ),
)


def known_gap(dtype: str, model: str, a: str, b: str) -> str | None:
    """The reason cell (dtype[+optimizer], model, a ↔ b) is expected to differ, or None."""
    dtype = dtype.partition("+")[0]
    for g in KNOWN_GAPS:
        if dtype not in g.dtypes or (g.models is not None and model not in g.models):
            continue
        ina, inb = a in g.frameworks, b in g.frameworks
        if (ina != inb) or (g.within and ina and inb):
            return g.reason
    return None


TORCH_OPTIMIZER_HOOKS: str = (
    "torch adapter: with watch(..., optimizer=opt), step t's param is read in the "
    "optimizer's step pre-hook, i.e. after batch t's forward pass, so BatchNorm "
    "running_mean/running_var (and the probe's eval-mode activations) are those *after* "
    "batch t; without an optimizer (handle.step()) and in Keras/JAX they are those "
    "before batch t. The conformance runs use handle.step(); fix: copy buffers and run "
    "the probe at the step boundary (traintape/adapters/torch/watch.py)"
)
"""Known gap exercised by tests/test_conformance.py (strict xfail)."""
