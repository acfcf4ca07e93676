"""Run one framework's conformance trainings in this process (called in a subprocess).

``python -m conformance.worker FRAMEWORK CONFIG OUT_DIR [MODEL ...]`` writes one store per
model to ``OUT_DIR/<config>/<framework>/<model>``; CONFIG is a dtype (``float32``,
``float64``: SGD with momentum) or a dtype with ``+adam``.
"""

from __future__ import annotations

import sys
from pathlib import Path

from conformance import spec as S

FRAMEWORKS = ("torch", "tf", "jax-linen", "jax-nnx", "equinox", "keras-jax", "keras-torch")
KERAS_BACKENDS = {"keras-jax": "jax", "keras-torch": "torch"}
"""Columns of the Keras models (``models_tf``) run on another Keras 3 backend: the same
script with ``KERAS_BACKEND`` set, as a user switches backends."""


def written_in(framework: str) -> tuple[str, ...]:
    """The models ``framework`` has (every one, today; a framework lacking one lists its
    own, and its cells report the model as not written)."""
    if framework == "equinox":
        from conformance.models_equinox import MODELS

        return MODELS
    return tuple(S.MODELS)


def train(framework: str, model: str, url: str, config: str) -> None:
    """Train one conformance model in one framework into the store ``url``."""
    dtype, opt = S.dtype_of(config), S.optimizer_of(config)
    if framework == "torch":
        from conformance import models_torch as M
    elif framework == "tf":
        from conformance import models_tf as M  # type: ignore[no-redef]
    elif framework == "jax-linen":
        from conformance import models_jax

        models_jax.train(model, url, dtype, "linen", optimizer=opt)
        return
    elif framework == "jax-nnx":
        from conformance import models_jax

        models_jax.train(model, url, dtype, "nnx", optimizer=opt)
        return
    elif framework == "equinox":
        from conformance import models_equinox as M  # type: ignore[no-redef]
    elif framework in KERAS_BACKENDS:
        _keras_backend(KERAS_BACKENDS[framework], dtype)
        from conformance import models_tf as M  # type: ignore[no-redef]
    else:
        raise KeyError(framework)
    M.train(model, url, dtype, optimizer=opt)


def _keras_backend(backend: str, dtype: str) -> None:
    """Select Keras's backend for this worker process (before Keras is imported); JAX
    computes in float64 only with x64 enabled."""
    import os

    if "keras" in sys.modules and os.environ.get("KERAS_BACKEND") != backend:
        raise RuntimeError(f"keras is already imported with another backend than {backend}")
    os.environ["KERAS_BACKEND"] = backend
    if backend == "jax" and dtype == "float64":
        import jax

        jax.config.update("jax_enable_x64", True)


def store_path(root: str | Path, framework: str, model: str, dtype: str) -> Path:
    return Path(root) / dtype / framework / model


def main(argv: list[str]) -> int:
    framework, dtype, out, *models = argv
    for m in models or list(S.MODELS):
        if m not in written_in(framework):
            continue
        train(framework, m, str(store_path(out, framework, m, dtype)), dtype)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
