"""The compare half of the verdict corpus: correct ports (expected identical) and planted
bugs (expected differs, at the declared tensor, kind and step).

Every case is judged the way a user runs it: ``traintape.compare(a, b)`` with default
options, once on the statistics only (``snapshots=False``) and once with the snapshots
the runs recorded; a case is right only when both say the expected thing. Run A is the
torch store (the torch adapter records the forward order compare uses to name the
*first* layer), run B the Flax one. bf16 cases use compare's precision mode where the
library has one (``precision='bf16'``), else the defaults.

Each false verdict on a port is attributed to a cause (:func:`cause_of`) from the
recorded numbers: ``grad-under-clipping`` (every grad of the step differs by the same
factor: one run recorded the clipped gradient), ``noise-floor stats`` (a scale-free
statistic of a tensor whose l2 is rounding noise next to its kind's largest tensor),
``update-as-applied`` (``update`` ``zero_frac``: one run records θ_{t+1} − θ_t after
rounding, the other the optimizer's output), ``Adam rounding`` (``update``/``opt_state``
of an Adam run: gradient rounding magnified by lr/(√v̂ + ε)), ``bf16 rounding``,
``snapshot element noise`` (a snapshot element near zero in a tensor of large norm,
held to an absolute atol), ``rounding growth over steps`` (a statistic a little beyond
the fixed rtol after a few steps), ``Adam-amplified noise`` (the param, or the layer's
output, of a parameter whose gradient is zero in exact arithmetic — the key bias: Adam
normalises its rounding noise into steps of size ~lr, so the two runs' key biases walk
apart), else ``other``. These name what the false verdict
came from; ``update-as-applied`` also covers θ ≈ 1 (norm scales), whose applied update
θ_{t+1} − θ_t carries a relative error ulp(θ)/|u| in float32.
"""

from __future__ import annotations

import fnmatch
import inspect
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from verdict_corpus import CaseResult, Rate, Section
from verdict_corpus import arch as A
from verdict_corpus.bugs import BUGS, QUICK_BUGS, Bug


@dataclass(frozen=True)
class Port:
    """A correct port: the torch port and the JAX one (``flavour`` 'nnx' or 'linen': Flax;
    'equinox': the MLP only)."""

    arch: str
    recipe: str
    dtype: str = "float32"
    flavour: str = "nnx"
    bf16: bool = False
    micro_batches: int = 1

    @property
    def name(self) -> str:
        extra = "-bf16" if self.bf16 else ""
        extra += f"-accum{self.micro_batches}" if self.micro_batches > 1 else ""
        fl = "" if self.flavour == "nnx" else f"-{self.flavour}"
        return f"{self.arch}{fl}-{self.recipe}-{self.dtype}{extra}"

    @property
    def frameworks(self) -> str:
        return "torch / equinox" if self.flavour == "equinox" else f"torch / flax-{self.flavour}"

    @property
    def expected(self) -> str:
        return "identical-at-precision" if self.bf16 else "identical"


PORTS: tuple[Port, ...] = (
    *(Port(a, "sgd") for a in A.ARCHS),
    *(Port(a, "adamw") for a in ("gpt", "bert", "llama", "vit", "resnet", "moe")),
    *(Port(a, "adam") for a in ("conv1d", "lstm", "gru", "moe", "mlp")),
    Port("mlp", "sgd_clip"),
    Port("conv1d", "sgd", micro_batches=2),
    *(Port(a, r, "float64") for a, r in (("gpt", "sgd"), ("bert", "adamw"), ("llama", "adamw"),
                                          ("resnet", "sgd"), ("lstm", "adam"), ("mlp", "sgd"))),
    Port("llama", "adamw", flavour="linen"),
    Port("mlp", "sgd", flavour="equinox"),
    Port("mlp", "adam", flavour="equinox"),
    Port("llama", "adamw", "float64", flavour="linen"),
    Port("mlp", "sgd", bf16=True),
    Port("gpt", "sgd", bf16=True),
)  # fmt: skip

QUICK_PORTS = ("gpt-sgd-float32", "llama-adamw-float32", "lstm-adam-float32", "mlp-sgd-float32",
               "mlp-sgd-float64")  # fmt: skip


def _ref_port(bug: Bug) -> Port:
    """The correct port a bug is compared against (same arch, recipe, dtype)."""
    return Port(bug.arch, bug.recipe, bug.dtype, micro_batches=bug.micro_batches)


# ----------------------------------------------------------------------------- running
class Runs:
    """Trains and caches the stores under ``workdir`` (one per port, side and bug)."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self._shapes: dict[str, dict[str, tuple[int, ...]]] = {}

    def shapes(self, arch: str) -> dict[str, tuple[int, ...]]:
        if arch not in self._shapes:
            from verdict_corpus import ports_torch

            self._shapes[arch] = ports_torch.canonical_shapes(arch)
        return self._shapes[arch]

    def torch(self, port: Port, bug: str | None = None) -> str:
        url = self.workdir / port.name / f"torch{'-' + bug if bug else ''}"
        if not url.exists():
            from verdict_corpus import ports_torch

            ports_torch.train(port.arch, str(url), port.dtype, port.recipe, bug=bug,
                              micro_batches=port.micro_batches, bf16=port.bf16)  # fmt: skip
        return str(url)

    def flax(self, port: Port, bug: str | None = None) -> str:
        url = self.workdir / port.name / f"{port.flavour}{'-' + bug if bug else ''}"
        if not url.exists():
            from verdict_corpus import ports_jax

            if port.flavour == "equinox":
                from verdict_corpus import ports_equinox

                ports_equinox.train_mlp(str(url), port.dtype, port.recipe, self.shapes(port.arch))
            elif port.flavour == "linen":
                ports_jax.train_linen_llama(str(url), port.dtype, port.recipe,
                                            self.shapes(port.arch))  # fmt: skip
            else:
                ports_jax.train_nnx(port.arch, str(url), port.dtype, port.recipe,
                                    self.shapes(port.arch), bug=bug, bf16=port.bf16)  # fmt: skip
        return str(url)


def _compare(a: str, b: str, snapshots: bool, bf16: bool) -> Any:
    """``traintape.compare`` with default options (precision mode for bf16 if present)."""
    import traintape

    kw: dict[str, Any] = {"snapshots": snapshots}
    if bf16 and "precision" in inspect.signature(traintape.compare).parameters:
        kw["precision"] = "bf16"
    return traintape.compare(a, b, **kw)


def _verdict(rep: Any) -> str:
    fd = rep.first_divergence
    if rep.identical:
        return "identical"
    if fd is None:
        return "differs: " + "; ".join(s.message for s in rep.structural[:2])
    return f"differs: {fd.kind} {fd.tensor} @{fd.first_step_out} ({fd.first_out_via})"


# ----------------------------------------------------------------------------- causes
SCALE_FREE = ("sig", "zero_frac", "mean", "std", "min", "max")
"""Statistics that stay O(1) or relative when a tensor is pure rounding noise."""


def _l2_at(run: Any, kind: str, step: int) -> dict[str, float]:
    names = run.tensor_names(kind)
    col = list(run.manifest.stat_names).index("l2")
    row = int(np.flatnonzero(run.steps == step)[0])
    vals = run.stats_array(kind, rows=slice(row, row + 1))[0][:, col]
    return dict(zip(names, (float(v) for v in vals), strict=True))


def _ulp_over_update(run: Any, name: str, step: int) -> float:
    """ulp of the parameter's largest element over the update's rms: the relative error
    of θ_{t+1} − θ_t computed in storage dtype (what the torch adapter records)."""
    stats = list(run.manifest.stat_names)
    row = int(np.flatnonzero(run.steps == step)[0])

    def at(kind: str) -> np.ndarray:
        j = run.tensor_names(kind).index(name)
        return run.stats_array(kind, rows=slice(row, row + 1))[0][j]

    p, u = at("param"), at("update")
    spec = next(s for s in run.manifest.specs("update") if s.name == name)
    big = max(abs(p[stats.index("min")]), abs(p[stats.index("max")]))
    rms = u[stats.index("l2")] / np.sqrt(max(int(np.prod(spec.shape)), 1))
    eps = float(np.finfo(np.dtype(spec.dtype)).eps)
    return float(eps * big / rms) if rms > 0 else float("inf")


def cause_of(td: Any, ra: Any, rb: Any, port: Port, cache: dict[Any, Any] | None = None) -> str:
    """Why one out-of-tolerance tensor (a ``TensorDiff``) of a correct port left
    tolerance (see the module docstring). ``ra``/``rb``: the open runs."""
    cache = {} if cache is None else cache
    recipe = A.RECIPES[port.recipe]
    kind, step, via = td.kind, td.first_step_out, td.first_out_via
    if kind == "metrics":
        return f"other (metric {td.tensor})"

    def l2(run: Any, tag: str) -> dict[str, float]:
        if (tag, kind, step) not in cache:
            cache[(tag, kind, step)] = _l2_at(run, kind, step)
        return cache[(tag, kind, step)]

    la, lb = l2(ra, "a"), l2(rb, "b")
    top = max(max(la.values()), max(lb.values()))
    if kind == "grad" and recipe.clip is not None:
        ratios = np.array([la[n] / lb[n] for n in la if n in lb and lb[n] > 1e-3 * top])
        if ratios.size and abs(ratios.mean() - 1) > 1e-3 and ratios.std() < 1e-4 * ratios.mean():
            return f"grad-under-clipping (every grad x{ratios.mean():.4g} at step {step})"
    if kind == "update" and via == "zero_frac":
        return "update-as-applied (zero_frac)"
    if kind == "update":
        ratio = _ulp_over_update(ra, td.tensor, step)
        if ratio > td.rtol:
            return f"update-as-applied ({via}: ulp(θ)/rms(update) = {ratio:.2g})"
    small = max(la.get(td.tensor, 0.0), lb.get(td.tensor, 0.0)) < 1e-4 * top
    if via in SCALE_FREE and small:
        return (
            f"noise-floor stats ({via} of a tensor at l2 {la.get(td.tensor, 0):.2g} vs {top:.2g})"
        )
    if kind in ("update", "opt_state") and recipe.optimizer in ("adam", "adamw"):
        return f"Adam rounding ({kind} {via}, max rel {td.max_rel:.2g})"
    if kind in ("param", "activation") and recipe.optimizer in ("adam", "adamw"):
        if ("grad0",) not in cache:
            cache[("grad0",)] = (_l2_at(ra, "grad", 0), _l2_at(rb, "grad", 0))
        ga, gb = cache[("grad0",)]
        gtop = max(max(ga.values()), max(gb.values()))
        layer = td.tensor.rsplit("/", 1)[0] + "/"
        noise = [n for n in ga if n.startswith(layer) and max(ga[n], gb.get(n, 0)) < 1e-4 * gtop]
        if noise:
            return (
                f"Adam-amplified noise ({kind}: {noise[0]} has a zero gradient in exact "
                f"arithmetic; Adam turns its rounding noise into lr-sized steps)"
            )
    if port.bf16:
        return f"bf16 rounding ({via}, max rel {td.max_rel:.2g})"
    if via == "snapshot":
        return (
            f"snapshot element noise ({kind}: max abs {td.max_abs:.2g} on elements far below "
            f"the tensor's scale; element-wise atol is not relative to the tensor)"
        )
    if step > 0 and td.max_rel is not None and td.max_rel < 1e-2:
        return f"rounding growth over steps ({kind} {via} at step {step}, max rel {td.max_rel:.2g})"
    return f"other ({kind} {via}, max abs {td.max_abs:.2g}, max rel {td.max_rel:.2g})"


def causes(reps: list[Any], a: str, b: str, port: Port) -> str:
    """The cause of each report's first divergence, then a tally of the causes of every
    (tensor, kind) out of tolerance in any of the reports — what would still say
    'differs' once the first cause is fixed."""
    import traintape

    ra, rb = traintape.open_run(a), traintape.open_run(b)
    cache: dict[Any, Any] = {}
    first = [cause_of(r.first_divergence, ra, rb, port, cache) for r in reps
             if r.first_divergence is not None]  # fmt: skip
    tally: dict[str, set[tuple[str, str]]] = {}
    for r in reps:
        for td in r.tensors:
            if not td.within and td.first_step_out is not None:
                label = cause_of(td, ra, rb, port, cache).split(" (")[0]
                tally.setdefault(label, set()).add((td.kind, td.tensor))
    counts = ", ".join(
        f"{k} {len(v)}" for k, v in sorted(tally.items(), key=lambda kv: -len(kv[1]))
    )
    return f"first: {'; '.join(dict.fromkeys(first))} — every tensor out: {counts}"


# ----------------------------------------------------------------------------- cases
def _located(rep: Any, bug: Bug) -> bool:
    fd = rep.first_divergence
    return (
        fd is not None
        and fd.kind == bug.kind
        and fd.first_step_out == bug.step
        and any(fnmatch.fnmatchcase(fd.tensor, p) for p in bug.where)
    )


def run_port(runs: Runs, port: Port) -> CaseResult:
    t0 = time.perf_counter()
    try:
        a, b = runs.torch(port), runs.flax(port)
        reps = [_compare(a, b, s, port.bf16) for s in (False, True)]
    except Exception as e:  # a case that cannot run is a wrong verdict, with the reason
        return CaseResult(port.name, "port", port.frameworks, port.expected, f"error: {e!r}"[:120],
                          False, None, traceback.format_exc(limit=3), time.perf_counter() - t0)  # fmt: skip
    got = [_verdict(r) for r in reps]
    ok = all(r.identical for r in reps)
    detail = "" if ok else causes(reps, a, b, port)
    text = got[1] if got[0] == got[1] else f"{got[1]} | stats-only: {got[0]}"
    return CaseResult(port.name, "port", port.frameworks, port.expected, text, ok, None, detail,
                      time.perf_counter() - t0)  # fmt: skip


def run_bug(runs: Runs, bug: Bug) -> CaseResult:
    t0 = time.perf_counter()
    port = _ref_port(bug)
    fw = "torch (bug) / flax-nnx" if bug.side == "torch" else "torch / flax-nnx (bug)"
    try:
        if bug.side == "torch":
            a, b = runs.torch(port, bug.planted), runs.flax(port)
        else:
            a, b = runs.torch(port), runs.flax(port, bug.planted)
        reps = [_compare(a, b, s, False) for s in (False, True)]
    except Exception as e:
        return CaseResult(bug.name, "bug", fw, bug.expected, f"error: {e!r}"[:120], False, False,
                          traceback.format_exc(limit=3), time.perf_counter() - t0)  # fmt: skip
    got = [_verdict(r) for r in reps]
    ok = not any(r.identical for r in reps)
    localised = ok and all(_located(r, bug) for r in reps)
    text = got[1] if got[0] == got[1] else f"{got[1]} | stats-only: {got[0]}"
    return CaseResult(bug.name, "bug", fw, bug.expected, text, ok, localised,
                      f"{bug.arch} {bug.recipe} {bug.dtype}: {bug.what}", time.perf_counter() - t0)  # fmt: skip


def rates(cases: list[CaseResult]) -> list[Rate]:
    ports = [c for c in cases if c.group == "port"]
    bugs = [c for c in cases if c.group == "bug"]
    false_differs = sum(not c.ok for c in ports)
    detected = sum(c.ok for c in bugs)
    localised = sum(bool(c.localised) for c in bugs)
    n = len(bugs)
    return [
        Rate("false differs on correct ports", false_differs, len(ports), "0", false_differs == 0),
        Rate("planted bugs detected", detected, len(bugs), ">= 95%", detected >= 0.95 * n),
        Rate("bugs localised to the right layer and step", localised, len(bugs), ">= 90%",
             localised >= 0.90 * n),
    ]  # fmt: skip


def select(quick: bool) -> tuple[list[Port], list[Bug]]:
    """The ports and bugs to run (``quick``: a subset of every group)."""
    if not quick:
        return list(PORTS), list(BUGS)
    return [p for p in PORTS if p.name in QUICK_PORTS], [b for b in BUGS if b.name in QUICK_BUGS]


def run(quick: bool, workdir: Path, names: list[str] | None = None) -> Section:
    """Run the compare corpus (``names``: only these cases) and return its Section."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # reduction order and speed independent of the machine's load
    ports, bugs = select(quick)
    if names is not None:
        ports = [p for p in ports if p.name in names]
        bugs = [b for b in bugs if b.name in names]
    runs = Runs(workdir)
    try:
        cases = [run_port(runs, p) for p in ports] + [run_bug(runs, b) for b in bugs]
    finally:
        torch.set_num_threads(threads)
    return Section("compare: correct ports and planted bugs", cases, rates(cases))
