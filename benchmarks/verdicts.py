"""How often traintape's verdicts are right, on a corpus of real training cases (issue 24).

Runs every case of the verdict corpus (``benchmarks/verdict_corpus/``): correct ports
between frameworks and planted porting/training bugs for ``compare``; healthy trainings
and planted pathologies for ``health`` and ``anomalies``. Prints one table per section
(every case: expected, got, right or wrong) and one summary table of rates against the
targets:

- compare: 0 false "differs" on correct ports; >= 95% of planted bugs detected, >= 90%
  localised to the right layer and step;
- health/anomalies: 0 critical and 0 warning on healthy runs; >= 90% of pathologies
  detected with the right issue type.

Usage: python benchmarks/verdicts.py [--quick] [--only compare|health] [--json PATH]
[--workdir DIR] [--keep]. Exit status 1 when a target is not met. CPU only; the full
corpus takes <= 30 min on 2 cores, ``--quick`` <= 5 min.
"""

from __future__ import annotations

import argparse
import importlib
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))  # conformance's models

from verdict_corpus import Section

SECTIONS = {"compare": "verdict_corpus.compare_cases", "health": "verdict_corpus.health_cases"}


def _print_section(section: Section) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=section.title)
    for col in ("case", "group", "frameworks", "expected", "got", "right", "localised", "s"):
        table.add_column(col)
    for c in section.cases:
        loc = "" if c.localised is None else ("yes" if c.localised else "NO")
        table.add_row(
            c.name, c.group, c.frameworks, c.expected, c.got,
            "yes" if c.ok else "NO", loc, f"{c.seconds:.1f}",
        )  # fmt: skip
    Console(width=200).print(table)


def _print_rates(sections: list[Section]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="verdict rates")
    for col in ("verdict", "measure", "value", "target", "met"):
        table.add_column(col)
    for s in sections:
        for r in s.rates:
            table.add_row(s.title, r.name, r.value, r.target, "yes" if r.met else "NO")
    Console(width=200).print(table)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a subset of every group (<= 5 min)")
    ap.add_argument("--only", choices=sorted(SECTIONS), action="append")
    ap.add_argument("--json", type=Path, help="write every case and rate as JSON here")
    ap.add_argument("--workdir", type=Path, help="record the stores here (default: a temp dir)")
    ap.add_argument("--keep", action="store_true", help="keep the recorded stores")
    args = ap.parse_args(argv)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="traintape-verdicts-"))
    sections: list[Section] = []
    t0 = time.perf_counter()
    try:
        for name in args.only or list(SECTIONS):
            module = importlib.import_module(SECTIONS[name])
            sub = workdir / name
            sub.mkdir(parents=True, exist_ok=True)
            section = module.run(quick=args.quick, workdir=sub)
            _print_section(section)
            sections.append(section)
    finally:
        if not args.keep and args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    _print_rates(sections)
    print(f"{sum(len(s.cases) for s in sections)} cases in {time.perf_counter() - t0:.0f} s")
    if args.json:
        args.json.write_text(json.dumps([s.to_json() for s in sections], indent=1))
    return 0 if all(r.met for s in sections for r in s.rates) else 1


if __name__ == "__main__":
    raise SystemExit(main())
