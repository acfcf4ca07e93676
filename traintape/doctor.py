"""``traintape doctor``: what this installation can do, and with which backends.

Reports the installed frameworks and their versions, the statistics backend each
adapter would use here (the value recorded as ``Producer.stats_backend``), the C compiler
and the native kernels' status (each: prebuilt at install, compiled at run time, or
unavailable and why), and the TensorStore kvstore drivers. Importing this
module imports no framework; :func:`diagnose` imports each installed one to ask it.
"""

from __future__ import annotations

import importlib.util
import platform
from dataclasses import dataclass, field


@dataclass
class Check:
    name: str
    value: str
    ok: bool = True
    detail: str = ""


@dataclass
class Diagnosis:
    checks: list[Check] = field(default_factory=list)

    def add(self, name: str, value: str, ok: bool = True, detail: str = "") -> None:
        self.checks.append(Check(name, value, ok, detail))


def _version(module: str) -> str | None:
    if importlib.util.find_spec(module) is None:
        return None
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(module)
    except PackageNotFoundError:
        return "installed"


def diagnose(frameworks: bool = True) -> Diagnosis:
    """Collect the checks (``frameworks``: import each installed framework to ask which
    stats backend its adapter uses — seconds for TF)."""
    from traintape._version import __version__
    from traintape.core import native
    from traintape.core.stats import backend
    from traintape.schema import SCHEMA_VERSION

    d = Diagnosis()
    d.add("traintape", f"{__version__} (schema {SCHEMA_VERSION})")
    d.add("python", f"{platform.python_version()} on {platform.machine()} {platform.system()}")
    cc = native.compiler()
    d.add("C compiler", cc or "none", ok=cc is not None,
          detail="" if cc else "set CC; without one the statistics use slower fallbacks")  # fmt: skip
    host = backend()
    where = f" ({native.origin()})" if host != "numpy" else ""
    d.add("host stats kernel", host + where, ok=host != "numpy",
          detail=native.unavailable_reason() if host == "numpy" else "")  # fmt: skip
    for fw in ("jax", "torch", "tensorflow"):
        v = _version(fw)
        if v is None:
            d.add(fw, "not installed", ok=True)
            continue
        if not frameworks:
            d.add(fw, v)
            continue
        try:
            d.add(fw, f"{v}; stats backend {_framework_backend(fw)}")
        except Exception as e:  # a broken install is worth reporting, not crashing on
            d.add(fw, v, ok=False, detail=f"{type(e).__name__}: {e}")
            continue
        if fw == "jax":
            _jax_ffi_kernel(d)
    import tensorstore as ts

    drivers = []
    for scheme, spec in (("file", "file:///tmp/"), ("memory", "memory://"),
                         ("gs", {"driver": "gcs", "bucket": "bucket"}),
                         ("s3", {"driver": "s3", "bucket": "bucket", "aws_region": "us-east-1"})):  # fmt: skip
        try:
            ts.KvStore.Spec(spec)
            drivers.append(scheme)
        except Exception:  # driver not compiled into this tensorstore
            pass
    d.add("tensorstore", f"{_version('tensorstore')}; kvstore drivers {', '.join(drivers)}")
    return d


def _jax_ffi_kernel(d: Diagnosis) -> None:
    """Where JAX's FFI stat kernel came from: prebuilt at install, compiled at run time,
    or unavailable and why (JAX then uses XLA reductions on the CPU)."""
    from traintape.adapters.jax import ffi_kernel

    if ffi_kernel.available():
        d.add("JAX FFI stats kernel", ffi_kernel.origin())
    else:
        d.add("JAX FFI stats kernel", "unavailable (XLA reductions on CPU)", ok=False,
              detail=ffi_kernel.unavailable_reason())  # fmt: skip


def _framework_backend(fw: str) -> str:
    if fw == "jax":
        import jax

        from traintape.adapters.jax.stats import stats_backend

        return f"{stats_backend()} (default device {jax.default_backend()})"
    if fw == "torch":
        import torch

        from traintape.adapters.torch.stats import stats_backend as torch_backend

        out = f"{torch_backend(torch.device('cpu'))} on cpu"
        if torch.cuda.is_available():
            out += f", {torch_backend(torch.device('cuda'))} on cuda"
        return out
    from traintape.adapters.tf.stats import stats_backend as tf_backend

    return tf_backend()
