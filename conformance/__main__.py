"""``python -m conformance``: run the conformance matrix, print it, exit 0 iff identical."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

from conformance import spec as S
from conformance.matrix import DTYPES, render, require_cells, run_matrix
from conformance.worker import FRAMEWORKS


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m conformance", description=__doc__)
    p.add_argument("--frameworks", nargs="+", default=list(FRAMEWORKS), choices=FRAMEWORKS)
    p.add_argument("--models", nargs="+", default=list(S.MODELS), choices=list(S.MODELS))
    p.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=DTYPES)
    p.add_argument("--out", default=None, help="keep the stores here (default: temp dir)")
    p.add_argument("--no-adam", action="store_true", help="SGD with momentum only")
    p.add_argument("--jobs", type=int, default=2, help="framework workers run at once")
    p.add_argument("--json", action="store_true", help="print the cells as JSON")
    p.add_argument(
        "--no-semantics",
        action="store_true",
        help="skip the kind-semantics case (conformance/semantics.py: grad pre-clip, "
        "update below half an ulp)",
    )
    p.add_argument(
        "--allow-known",
        action="store_true",
        help="exit 0 when every differing cell is a known gap (conformance/known.py)",
    )
    a = p.parse_args(argv)
    if len(set(a.frameworks)) < 2:
        p.error(
            f"--frameworks {' '.join(a.frameworks)}: the matrix would have zero cells "
            "(a cell compares two frameworks); name at least two"
        )
    cells = run_matrix(tuple(a.frameworks), tuple(a.dtypes), tuple(a.models), a.out, a.jobs,
                       adam=not a.no_adam)  # fmt: skip
    require_cells(cells, tuple(a.frameworks))
    cells += _semantics_cells(a)
    if a.json:
        print(json.dumps([asdict(c) | {"verdict": c.verdict} for c in cells], indent=2))
    else:
        from rich.console import Console

        Console(width=200).print(render(cells))
    from conformance.known import known_gap

    allowed = (
        (lambda c: known_gap(c.dtype, c.model, c.a, c.b) is not None)
        if a.allow_known
        else (lambda c: False)
    )
    ok = all(c.identical or allowed(c) for c in cells)
    return 0 if ok else 1


def _semantics_cells(a: argparse.Namespace) -> list:
    """The kind-semantics case's cells (:mod:`conformance.semantics`), float32 only."""
    from conformance import semantics

    fws = tuple(f for f in a.frameworks if f in semantics.FRAMEWORKS)
    if a.no_semantics or len(fws) < 2 or "float32" not in a.dtypes or "mlp" not in a.models:
        return []
    root = None if a.out is None else f"{a.out}/semantics"
    return semantics.run_case(root, fws)


if __name__ == "__main__":
    sys.exit(main())
