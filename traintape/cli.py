"""The ``traintape`` command line."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect
import json
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NoReturn

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Column, Table

app = typer.Typer(
    help="traintape: record, validate, compare and analyse neural-network training runs.",
    no_args_is_help=True,
    add_completion=False,
)


def make_console(stderr: bool = False) -> Console:
    """The one place the CLI's rich Console is made.

    On a terminal it is the terminal's width. Anywhere else (a pipe, ``| less``, a file,
    CI logs) there is no width to fit, so it is :data:`PIPE_WIDTH` columns unless
    ``$COLUMNS`` says otherwise: a wide table (``compare``) keeps every column instead of
    being squeezed or cut to rich's default of 80. ``--json`` is the machine-readable
    form of every analysis."""
    stream = sys.stderr if stderr else sys.stdout
    width = None
    if not (hasattr(stream, "isatty") and stream.isatty()) and not os.environ.get("COLUMNS"):
        width = PIPE_WIDTH
    return Console(stderr=stderr, width=width)


PIPE_WIDTH = 1000
"""Columns of the CLI's output when it is not a terminal (:func:`make_console`)."""

console = make_console()
err = make_console(stderr=True)


ProgressFn = Callable[[str, int, int], None]


def _fail(message: str, hint: str | None = None, code: int = 2) -> NoReturn:
    """Print ``error: message`` (and a hint) on stderr and exit with ``code``."""
    from rich.markup import escape

    err.print(f"[red]error:[/red] {escape(message)}", highlight=False, soft_wrap=True)
    if hint:
        err.print(f"  [dim]{escape(hint)}[/dim]", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def _store_problem(run: str) -> tuple[str, str | None] | None:
    """Why the local path ``run`` cannot be a run store (message, hint), or None.

    A remote URL is diagnosed by reading its manifest (``_open``), not here."""
    from traintape.core.kvstore import local_path, normalize_url
    from traintape.core.store import LocationKind, inspect_location

    if local_path(normalize_url(run)) is None:
        return None
    loc = inspect_location(run)
    path = loc.path
    assert path is not None
    if loc.kind is LocationKind.MISSING:
        parent = os.path.dirname(path.rstrip(os.sep)) or "."
        hint = (
            f"`traintape ls {parent}` lists the runs there"
            if loc.parent == parent and loc.parent_is_dir
            else "check the path"
        )
        return f"no run at {path}: no such file or directory", hint
    if loc.kind is LocationKind.NOT_A_DIRECTORY:
        return f"{path} is a file, not a run directory", "a run is the directory a Recorder wrote"
    if loc.kind is not LocationKind.STORE:
        from traintape.core.catalog import find_stores

        # only a directory with foreign entries can hold runs (an EMPTY one holds none)
        inner = find_stores(path, depth=2) if loc.kind is LocationKind.FOREIGN else []
        if inner:
            shown = ", ".join(os.path.relpath(x, path) for x in inner[:5])
            more = f" and {len(inner) - 5} more" if len(inner) > 5 else ""
            return (
                f"{path} is not a traintape run (no zarr.json), but it contains runs: "
                f"{shown}{more}",
                f"pass one of them, or `traintape ls {path}`",
            )
        return f"{path} is not a traintape run (no zarr.json)", None
    return None


def _open(run: str, check: bool = True):
    """Open ``run`` or exit 2 with a message that names the path and what is wrong
    (``check=False``: its manifest alone, without the plausibility checks of a reader)."""
    from traintape.core import NotAStoreError, open_run
    from traintape.core.reader import Run
    from traintape.schema import SchemaVersionError

    problem = _store_problem(run)
    if problem is not None:
        _fail(*problem)
    try:
        return open_run(run) if check else Run(run, check=False)
    except SchemaVersionError as e:
        _fail(f"{run}: {e}", "upgrade traintape to read this store")
    except NotAStoreError as e:
        _fail(str(e), "`traintape validate RUN` explains what is wrong with a store")
    except Exception as e:  # unreadable manifest, kvstore errors
        _fail(f"cannot open {run}: {type(e).__name__}: {e}")


@contextlib.contextmanager
def _reading(*runs: str) -> Iterator[None]:
    """Turn an error while reading stores into a message (TRAINTAPE_DEBUG=1 re-raises)."""
    try:
        yield
    except (typer.Exit, typer.Abort, KeyboardInterrupt):
        raise
    except Exception as e:
        if os.environ.get("TRAINTAPE_DEBUG"):
            raise
        first = str(e).splitlines()[0] if str(e) else ""
        _fail(
            f"cannot read {' or '.join(runs)}: {type(e).__name__}: {first}",
            " / ".join(f"`traintape validate {r}`" for r in runs)
            + " checks the store (TRAINTAPE_DEBUG=1 shows a traceback)",
        )


@contextlib.contextmanager
def _progress(label: str) -> Iterator[ProgressFn]:
    """A rich progress bar on stderr, fed by ``callback(stage, done, total)``.

    Shown only when stderr is a terminal (never mixed into piped or --json stdout), and
    removed when done.
    """
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    with Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=err,
        transient=True,
        disable=not err.is_terminal,
    ) as bar:
        task = bar.add_task(label, total=None)

        def callback(stage: str, done: int, total: int) -> None:
            desc = f"{label}: {stage}" if stage else label
            bar.update(task, description=desc, completed=done, total=total or None)

        yield callback


@app.command()
def demo(
    out: str = typer.Option("runs/demo", "--out", "-o", help="where to write the run"),
    steps: int = typer.Option(300, min=1, help="optimizer steps to train"),
    full_every: int = typer.Option(100, min=1, help="full snapshots every N steps"),
    seed: int = typer.Option(0, help="random seed"),
) -> None:
    """Train a small Flax model on a synthetic task, recording every step into OUT."""
    try:
        import jax  # noqa: F401
    except ImportError:
        err.print('[red]error:[/red] the demo needs JAX: pip install "traintape[jax]"')
        raise typer.Exit(2) from None
    from traintape.demo import run_demo, summary

    result = run_demo(out, steps, full_every=full_every, seed=seed, progress=True)
    console.print(summary(result), highlight=False)


@app.command()
def doctor(
    as_json: bool = typer.Option(False, "--json", help="machine-readable output"),
    quick: bool = typer.Option(False, "--quick", help="do not import the frameworks"),
) -> None:
    """What this installation can do: frameworks, stats backends, compiler, drivers."""
    from dataclasses import asdict

    from traintape.doctor import diagnose

    d = diagnose(frameworks=not quick)
    if as_json:
        print(json.dumps([asdict(c) for c in d.checks], indent=1))
        return
    t = Table("check", "value", "")
    for c in d.checks:
        t.add_row(
            _safe(c.name), _safe(c.value), "" if c.ok else f"[yellow]{_safe(c.detail)}[/yellow]"
        )
    console.print(t)


@app.command()
def schema(
    out: Path | None = typer.Option(None, "--out", "-o", help="write to a file instead"),
) -> None:
    """Print the JSON Schema of the run manifest (generated from the Pydantic models)."""
    from traintape.schema import manifest_json_schema_text

    text = manifest_json_schema_text()
    if out is None:
        sys.stdout.write(text)
    else:
        out.write_text(text)


@app.command()
def validate(
    run: str = typer.Argument(..., help="run directory or TensorStore kvstore URL"),
    as_json: bool = typer.Option(False, "--json", help="machine-readable output"),
    repair: bool = typer.Option(
        False, "--repair", help="remove temporary *.__lock files of interrupted writes"
    ),
) -> None:
    """Check a store: manifest, arrays, steps, commit mark, every chunk's checksum.

    Exit code 0 when valid, 1 with one line per problem otherwise.
    """
    from traintape.core import ValidationReport
    from traintape.core import validate as run_validate
    from traintape.core.kvstore import normalize_url

    problem = _store_problem(run)
    if problem is not None:
        report = ValidationReport(normalize_url(run), problems=[problem[0]])
    else:
        with _progress("validating") as cb:
            report = run_validate(run, progress=lambda done, total: cb("chunks", done, total))
        if repair and report.lock_files:
            _repair_locks(report)
    if as_json:
        print(
            json.dumps(
                {
                    "url": report.url,
                    "ok": report.ok,
                    "problems": report.problems,
                    "notes": report.notes,
                    "arrays_checked": report.arrays_checked,
                    "chunks_checked": report.chunks_checked,
                }
            )
        )
    elif report.ok:
        m = report.manifest
        assert m is not None
        console.print(
            f"[green]valid[/green] {report.url}: schema {m.schema_version}, "
            f"{m.commit.rows} rows, {len(m.tensors)} tensor specs, "
            f"{report.arrays_checked} arrays, {report.chunks_checked} chunks verified"
        )
    else:
        for p in report.problems:
            print(p)
    if not as_json:
        for n in report.notes:
            err.print(f"[dim]note: {n}[/dim]")
    raise typer.Exit(0 if report.ok else 1)


def _repair_locks(report: Any) -> None:
    """``validate --repair``: remove the temporary lock files, unless a writer claims the
    store (its in-flight writes are such files; the next writer removes them anyway)."""
    from traintape.core.claim import CLAIM_KEY
    from traintape.core.kvstore import KvStore
    from traintape.core.store import remove_lock_files

    if KvStore(report.url).read_bytes(CLAIM_KEY) is not None:
        err.print(
            f"not repaired: a writer claims {escape(report.url)} ({CLAIM_KEY}); close it "
            f"first (the next writer removes the lock files itself)"
        )
        return
    n = remove_lock_files(report.url, keep=(CLAIM_KEY + ".__lock",))
    report.notes = [n_ for n_ in report.notes if "__lock" not in n_]
    report.notes.append(f"repaired: removed {n} temporary *.__lock file(s)")
    report.lock_files = []


@app.command()
def show(run: str = typer.Argument(..., help="run directory or URL")) -> None:
    """Summarise a run: producer, policy, steps, tensors per kind, metrics, events."""
    r = _open(run)
    with _reading(run):
        _show(r)


_CONTROL = {c: f"\\x{c:02x}" for c in [*range(0x20), 0x7F] if c not in (0x09,)}


def _safe(x: object) -> str:
    """Text from a store, safe to print through rich: markup escaped, terminal control
    characters (escape sequences, carriage returns) shown as ``\\xNN``."""
    return escape(str(x).translate(_CONTROL))


def _show(r: Any) -> None:
    m = r.manifest
    p = m.producer
    console.print(
        f"[bold]{_safe(r.url)}[/bold]  run {_safe(m.run_id)}  status [cyan]{m.status}[/cyan]"
    )
    console.print(
        f"schema {_safe(m.schema_version)} · producer {_safe(p.framework or 'numpy')} "
        f"{_safe(p.framework_version or '')} ({_safe(p.adapter or 'Recorder')}) · traintape "
        f"{_safe(p.traintape_version)} · stats backend {_safe(p.stats_backend or 'not recorded')}"
    )
    steps = r.steps
    span = f"{int(steps[0])}..{int(steps[-1])}" if len(steps) else "none"
    console.print(
        f"{r.rows} rows (steps {span}) · policy {_safe(m.policy.model_dump(mode='json'))}"
    )
    t = Table("kind", "tensors", "snapshots", Column("example", overflow="fold"))
    for kind in r.kinds():
        names = r.tensor_names(kind)
        t.add_row(
            kind.value, str(len(names)), str(m.commit.snapshots.get(kind, 0)), _safe(names[0])
        )
    console.print(t)
    met = r.metrics()
    if len(met.columns):
        mt = Table("metric", "last step", "last value", "min", "max")
        for c in met.columns:
            col = met[c].dropna()
            if len(col):
                mt.add_row(
                    _safe(c),
                    str(col.index[-1]),
                    f"{col.iloc[-1]:.6g}",
                    f"{col.min():.6g}",
                    f"{col.max():.6g}",
                )
        console.print(mt)
    if m.events:
        console.print(f"[yellow]{len(m.events)} events[/yellow]")
        for e in m.events[:20]:
            console.print(
                f"  step {e.step} \\[{e.severity.value}] {_safe(e.type)}: {_safe(e.message)}"
            )
    w = m.writer
    console.print(
        f"writer: {w.commits} commits, {w.stalls} stalls ({w.stall_seconds:.3f} s)"
        + (f", [red]disabled: {_safe(w.error)}[/red]" if w.disabled else "")
    )


# ---------------------------------------------------------------------------- analysis


def _name_column(header: str, names: list[str], cap: int = 60) -> Column:
    """A table column for tensor/layer names: as wide as the longest (up to ``cap``) so
    that the numbers, not the names, give way in a narrow terminal; longer names fold."""
    width = max([len(header), *(len(n) for n in names)])
    return Column(header, min_width=min(width, cap), overflow="fold")


def _json_out(model) -> None:
    print(model.model_dump_json(indent=1))


def _dir_size(path: str) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            with contextlib.suppress(OSError):
                total += os.path.getsize(os.path.join(root, f))
    return total


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


_LOSS_TAIL = 1024
"""Rows read from the end of a metric to find its last logged value in ``ls``."""


def _ls_metric(r: Any) -> dict[str, Any] | None:
    """The run's loss (``loss``, else a metric named ``.../loss``, else its first metric):
    name, last logged value, its step — read from the last rows only, never the whole
    column (``{"name", "value", "step"}``, or None when nothing was logged)."""
    import numpy as np

    from traintape.core import layout as L
    from traintape.core.system import is_system

    names = [n for n in r.manifest.metrics if not is_system(n)]
    losses = [n for n in names if n == "loss" or n.rsplit("/", 1)[-1] == "loss"]
    name = "loss" if "loss" in names else (losses or names or [None])[0]
    if name is None or r.rows == 0:
        return None
    lo = max(0, r.rows - _LOSS_TAIL)
    vals = np.asarray(r.array(L.metric_path(name))[lo : r.rows].read().result())
    finite = np.flatnonzero(np.isfinite(vals))
    if not len(finite):
        return None
    i = int(finite[-1])
    return {"name": name, "value": float(vals[i]), "step": int(r.steps[lo + i])}


def _ls_step_time(r: Any) -> str:
    """When the last step's row was recorded (``sys/time``), else the manifest's last update
    (a run recorded without system metrics), as ISO 8601 UTC."""
    from datetime import UTC, datetime

    import numpy as np

    from traintape.core import layout as L

    if r.rows and "sys/time" in r.manifest.metrics:
        t = float(np.asarray(r.array(L.metric_path("sys/time"))[r.rows - 1].read().result()))
        if np.isfinite(t):
            return datetime.fromtimestamp(t, UTC).isoformat(timespec="seconds")
    return r.manifest.updated_at.isoformat(timespec="seconds")


def _ls_writer(url: str, status: str) -> tuple[str, dict[str, Any] | None]:
    """``live`` / ``stale`` / ``closed`` (or ``failed``) from the manifest's status and the
    writer claim's heartbeat (:mod:`traintape.core.claim`): an open run whose claim is
    fresh is being written (``live``); an open run with a stale claim or none is not
    (``stale``: its writer was killed or lost; the next Recorder resumes it)."""
    if status != "open":
        return status, None
    import time

    from traintape.core.claim import WriterClaim
    from traintape.core.kvstore import KvStore

    claim = WriterClaim(KvStore(url).kv, url)  # reads only: nothing is written
    info, _ = claim._read()
    if info is None:
        return "stale", None
    writer = {"host": info.host, "pid": info.pid, "since": info.started_at,
              "heartbeat_age_s": round(time.time() - info.heartbeat, 1)}  # fmt: skip
    return ("live" if claim.looks_live(info) else "stale"), writer


def _ls_row(path: str, open_run: Callable[[str], Any]) -> dict[str, Any]:
    """One row of ``ls``: the run's summary, or its path and error if it cannot be read.

    ``size_bytes`` is the bytes on disk of a local run, None for a remote one (object
    stores list keys, not sizes: ``ls`` shows "–" rather than a wrong number)."""
    from traintape.core.kvstore import local_path, normalize_url

    try:
        r = open_run(path)
        st = r.steps
        status, writer = _ls_writer(r.url, r.manifest.status)
        metric = _ls_metric(r)
        step_time = _ls_step_time(r)
    except Exception as e:  # an invalid store is listed, not fatal
        return {"path": path, "error": str(e)}
    local = local_path(normalize_url(path))
    return {
        "path": path,
        "run_id": r.manifest.run_id,
        "rows": r.rows,
        "first_step": int(st[0]) if len(st) else None,
        "last_step": int(st[-1]) if len(st) else None,
        "framework": r.manifest.producer.framework or "numpy",
        "size_bytes": _dir_size(local) if local is not None else None,
        "status": status,
        "writer": writer,
        "metric": metric,
        "last_step_time": step_time,
        "updated_at": r.manifest.updated_at.isoformat(),
    }


def _rel(path: str, root: str) -> str:
    """``path`` relative to ``root`` (a directory or a URL prefix) for display."""
    from traintape.core.kvstore import is_local, normalize_url

    if not is_local(root):
        return path[len(normalize_url(root).rstrip("/")) + 1 :].rstrip("/") or "."
    return os.path.relpath(path, root)


@app.command("ls")
def ls_runs(
    directory: str = typer.Argument(".", help="directory to search (3 levels deep)"),
    as_json: bool = typer.Option(False, "--json", help="machine-readable output"),
) -> None:
    """List the runs under DIR: steps, framework, size, status (live / stale / closed), the
    last loss (or first metric) and when the last step was recorded."""
    from traintape.core import open_run
    from traintape.core.catalog import find_stores
    from traintape.core.kvstore import is_local

    remote = not is_local(directory)
    if not remote and not os.path.exists(directory):
        _fail(f"no such directory: {directory}")
    if not remote and not os.path.isdir(directory):
        _fail(f"{directory} is a file, not a directory", "`traintape show RUN` shows one run")
    rows = []
    try:
        found = find_stores(directory)
    except Exception as e:  # unreachable endpoint, no such bucket, no credentials
        _fail(f"cannot list {directory}: {e}")
    with _progress("listing runs") as cb:
        for i, path in enumerate(found):
            cb(_rel(path, directory), i, len(found))
            rows.append(_ls_row(path, open_run))
        cb("", len(found), len(found))

    if as_json:
        print(json.dumps(rows, indent=1))
        return
    if not rows:
        console.print(f"no traintape runs under {directory}")
        return
    t = Table(
        Column("run", overflow="fold"), "steps", "framework", "size", "status",
        "last metric", "last step at (UTC)",
    )  # fmt: skip
    for x in rows:
        if "error" in x:
            t.add_row(
                _safe(_rel(x["path"], directory)), "", "", "", "[red]invalid[/red]",
                _safe(x["error"][:60]), "",
            )  # fmt: skip
            continue
        span = f"{x['rows']} ({x['first_step']}..{x['last_step']})" if x["rows"] else "0"
        color = {"closed": "green", "live": "cyan", "stale": "yellow", "failed": "red"}.get(
            x["status"], "white"
        )
        m = x["metric"]
        metric = "–" if m is None else f"{_safe(m['name'])} {m['value']:.4g} @ {m['step']}"
        size = "–" if x["size_bytes"] is None else _human(x["size_bytes"])
        t.add_row(
            _safe(_rel(x["path"], directory)), span, _safe(x["framework"]), size,
            f"[{color}]{_safe(x['status'])}[/{color}]", metric,
            x["last_step_time"][:19].replace("T", " "),
        )  # fmt: skip
    console.print(t)


_COLOR = {"healthy": "green", "info": "blue", "warning": "yellow", "critical": "red"}
_GLYPH = {"healthy": "·", "warning": "▲", "critical": "✖"}
_SEVERITY = {"healthy": 0, "warning": 1, "critical": 2}


def _status(s: str) -> str:
    return f"[{_COLOR[s]}]{s}[/{_COLOR[s]}]"


def _strip(statuses: list[Any], most: int = 60) -> tuple[str, int]:
    """Statuses as one coloured mark each (at most ``most`` marks: each then stands for
    the worst of ``per`` consecutive windows); returns ``(text, per)``."""
    per = max(1, -(-len(statuses) // most))
    groups = [statuses[i : i + per] for i in range(0, len(statuses), per)]
    worst = [max(g, key=lambda s: _SEVERITY[s]) for g in groups]
    return "".join(f"[{_COLOR[s]}]{_GLYPH[s]}[/{_COLOR[s]}]" for s in worst), per


def _health_table(rep: Any) -> None:
    """The per-layer table and issue list of one health report."""
    f = lambda v: "–" if v is None else f"{v:.3g}"  # noqa: E731
    # (header, value of a layer); a column no layer has a value for is left out
    cols: list[tuple[str, Callable[[Any], str]]] = [
        ("score", lambda lh: f"{lh.score:.0f}"),
        ("status", lambda lh: _status(lh.status)),
        ("median grad norm", lambda lh: f(lh.grad_norm)),
        ("median grad/param", lambda lh: f(lh.rel_grad)),
        ("median update/param", lambda lh: f(lh.update_ratio)),
        ("median zero act", lambda lh: f(lh.act_zero_frac)),
    ]
    cols = [(h, v) for h, v in cols if any(v(lh) != "–" for lh in rep.layers)]
    t = Table(
        _name_column("layer", [lh.layer for lh in rep.layers], cap=40),
        *(h for h, _ in cols),
        Column("issues", overflow="fold"),
    )
    for lh in rep.layers:
        t.add_row(
            _safe(lh.layer), *(v(lh) for _, v in cols), ", ".join(str(i.type) for i in lh.issues)
        )
    console.print(t)
    for i in rep.issues():
        c = _COLOR[i.severity]
        where = _safe(i.layer or "run")
        console.print(f"[{c}]{i.type}[/{c}] {where}: {_safe(i.message)}")
    _recommendations(rep.issues())


def _recommendations(issues: list[Any]) -> None:
    """Each recommendation of ``issues`` once, with the layers it applies to."""
    from traintape.analysis import recommendations

    recs = recommendations(i for i in issues if i.severity != "info")
    if recs:
        console.print("[bold]recommendations[/bold]")
    for r in recs:
        c = _COLOR[r.severity]
        where = ", ".join(_safe(x) for x in r.layers[:6])
        if len(r.layers) > 6:
            where += f", … ({len(r.layers)} layers)"
        console.print(f"[{c}]{r.type}[/{c}] ({where})\n    → {_safe(r.recommendation)}")


def _checks_table(results: list[Any]) -> None:
    """The registered user checks' results (``health``): a row per check, then each
    issue and failure."""
    if not results:
        return
    colour = {**_COLOR, "error": "red"}
    f = lambda v: "–" if v is None else f"{v:.4g}"  # noqa: E731
    t = Table(
        _name_column("check", [c.name for c in results], cap=40), "kind", "status", "value",
        Column("values", overflow="fold"), Column("issues / error", overflow="fold"),
        title="registered checks",
    )  # fmt: skip
    for c in results:
        vals = ", ".join(f"{_safe(k)}: {f(v)}" for k, v in list(c.values.items())[:4])
        if len(c.values) > 4:
            vals += f", … ({len(c.values)} in all)"
        what = (
            f"[red]{_safe(c.error)}[/red]"
            if c.error is not None
            else "; ".join(f"{i.severity}: {_safe(i.message)}" for i in c.issues[:3])
            + (f"; … {len(c.issues) - 3} more" if len(c.issues) > 3 else "")
        )
        st = c.status
        t.add_row(
            _safe(c.name), c.kind, f"[{colour[st]}]{st}[/{colour[st]}]",
            f(c.value) + (f" {_safe(c.unit)}" if c.unit and c.value is not None else ""),
            vals, what,
        )  # fmt: skip
    console.print(t)
    for c in results:
        for i in c.issues:
            if i.severity == "info":
                continue
            where = _safe(i.layer or "run") + (f" at step {i.step}" if i.step is not None else "")
            console.print(
                f"[{_COLOR[i.severity]}]{_safe(c.name)}[/{_COLOR[i.severity]}] {where}: "
                f"{_safe(i.message)}"
                + (f"\n    → {_safe(i.recommendation)}" if i.recommendation else "")
            )


def _health_trend(r: Any, run: str, window: int, as_json: bool, th: Any = None) -> None:
    """``health --window N``: each layer's status per window, its changes and episodes."""
    from traintape.analysis import health_trend

    with _reading(run), _progress("health") as cb:
        tr = health_trend(r, window, th, progress=cb)
    code = 1 if tr.worst == "critical" else 0
    if as_json:
        _json_out(tr)
        raise typer.Exit(code)
    ws = tr.windows
    if not ws:
        console.print(f"[bold]{_safe(r.url)}[/bold]: no recorded steps")
        raise typer.Exit(0)
    bad = [w for w, s in zip(ws, tr.status, strict=True) if s == tr.worst]
    console.print(
        f"[bold]{_safe(r.url)}[/bold]: {tr.steps} steps in {len(ws)} windows of {window} steps "
        f"— worst {_status(tr.worst)}"
        + (f" (from step {bad[0].first_step})" if tr.worst != "healthy" else "")
    )
    f = lambda v: "–" if v is None else f"{v:.3g}"  # noqa: E731
    top = lambda xs: max((x for x in xs if x is not None), default=None)  # noqa: E731
    _, per = _strip(tr.status)
    head = f"steps {ws[0].first_step}…{ws[-1].last_step}" + (
        f" ({per} windows a mark)" if per > 1 else ""
    )
    t = Table(
        _name_column("layer", [lt.layer for lt in tr.layers], cap=40),
        Column(head, no_wrap=True), "last", "turb.", "pressure", "velocity",
        Column("changes", overflow="fold"),
        caption="turb., pressure, velocity: the largest over the windows",
    )  # fmt: skip
    t.add_row("(run)", _strip(tr.status)[0], _status(tr.status[-1]), "", "", "", "")
    for lt in tr.layers:
        ch = [
            f"{c.before} → {c.after} at {c.step}"
            + (f" ({', '.join(str(i) for i in c.issues)})" if c.issues else "")
            for c in lt.changes
        ]
        more = f"; … {len(ch) - 3} more" if len(ch) > 3 else ""
        t.add_row(
            _safe(lt.layer), _strip(lt.status)[0], _status(lt.status[-1]), f(top(lt.turbulence)),
            f(top(lt.max_pressure)), f(top(lt.velocity)), "; ".join(ch[:3]) + more,
        )  # fmt: skip
    console.print(t)
    depth = {lt.layer: lt.depth for lt in tr.layers}
    for i in sorted(tr.issues(), key=lambda i: (i.first_step, depth.get(i.layer or "", -1))):
        c = _COLOR[i.severity]
        span = f"steps {i.first_step}..{i.last_step}" + (
            f" ({i.windows} windows)" if i.windows > 1 else ""
        )
        console.print(f"[{c}]{i.type}[/{c}] {_safe(i.layer or 'run')}, {span}: {_safe(i.message)}")
    _recommendations(tr.issues())
    raise typer.Exit(code)


def _health_against(r: Any, run: str, b: Any, against: str, as_json: bool, th: Any = None) -> None:
    """``health A --against B``: per layer, is A improved, degraded or unchanged?"""
    from traintape.analysis import NoSharedLayersError, Verdict, health_against

    with _reading(run, against), _progress("health") as cb:
        try:
            cmp = health_against(r, b, th, progress=cb)
        except NoSharedLayersError as e:
            _fail(str(e), "--against compares runs of one model: their layer names must match")
    counts = cmp.counts()
    code = 1 if counts[Verdict.DEGRADED] or cmp.verdict == Verdict.DEGRADED else 0
    if as_json:
        _json_out(cmp)
        raise typer.Exit(code)
    vc = {"improved": "green", "degraded": "red", "unchanged": "cyan"}
    v = cmp.verdict
    st = (
        _status(cmp.status_after)
        if cmp.status_before == cmp.status_after
        else f"{_status(cmp.status_before)} → {_status(cmp.status_after)}"
    )
    console.print(
        f"[bold]{_safe(cmp.a)}[/bold] against [bold]{_safe(cmp.b)}[/bold]: "
        f"[{vc[v]}]{v}[/{vc[v]}] — score {cmp.score_before:.0f} → {cmp.score_after:.0f}, "
        f"status {st}"
    )
    console.print(
        f"{counts[Verdict.IMPROVED]} improved, {counts[Verdict.DEGRADED]} degraded, "
        f"{counts[Verdict.UNCHANGED]} unchanged of {len(cmp.layers)} shared layers"
    )
    shown = [lc for lc in cmp.layers if lc.verdict != "unchanged" or len(cmp.layers) <= 30]
    t = Table(
        _name_column("layer", [lc.layer for lc in shown], cap=40), "verdict", "status", "score",
        Column("evidence", overflow="fold"),
    )  # fmt: skip
    for lc in shown:
        status = (
            _status(lc.status_after)
            if lc.status_before == lc.status_after
            else f"{_status(lc.status_before)} → {_status(lc.status_after)}"
        )
        score = (
            f"{lc.score_after:.0f}"
            if lc.score_before == lc.score_after
            else f"{lc.score_before:.0f} → {lc.score_after:.0f}"
        )
        # the reason, where the score (shown) did not decide the verdict
        why = lc.evidence()
        if lc.verdict != Verdict.UNCHANGED and lc.score_before == lc.score_after:
            why = f"{lc.reason}; {why}"
        t.add_row(
            _safe(lc.layer), f"[{vc[lc.verdict]}]{lc.verdict}[/{vc[lc.verdict]}]", status, score,
            _safe(why.rstrip("; ")),
        )  # fmt: skip
    if shown:
        console.print(t)
    if len(shown) < len(cmp.layers):
        console.print(f"{len(cmp.layers) - len(shown)} unchanged layers not shown (--json has all)")
    for i in cmp.run_issues:
        console.print(f"run: {i.text()} — {_safe(i.message)}")
    for name, only in (("A", cmp.only_in_a), ("B", cmp.only_in_b)):
        if only:
            shown_names = ", ".join(_safe(x) for x in only[:10]) + (" …" if len(only) > 10 else "")
            console.print(f"[dim]{len(only)} layers only in {name}: {shown_names}[/dim]")
    for lc in cmp.layers:
        for i in lc.issues:
            if i.after is not None and i.before != i.after:
                c = _COLOR[i.after]
                console.print(
                    f"[{c}]{i.text()}[/{c}] {_safe(lc.layer)}: {_safe(i.message)}"
                    f"\n    → {i.recommendation}"
                )
    raise typer.Exit(code)


def _thresholds(model: Any, items: list[str] | None, command: str) -> Any:
    """``--threshold NAME=VALUE`` options → an instance of the thresholds ``model`` (a
    Pydantic model), each NAME one of its fields; exits 2 naming a malformed item, an
    unknown field (listing the known ones) or a value the field does not accept."""
    from pydantic import ValidationError

    fields = list(model.model_fields)
    values: dict[str, str] = {}
    for item in items or []:
        name, sep, value = item.partition("=")
        name, value = name.strip(), value.strip()
        if not sep or not name or not value:
            _fail(
                f"--threshold {item!r}: expected NAME=VALUE",
                f"e.g. --threshold {fields[0]}=0.5",
            )
        if name not in fields:
            _fail(
                f"--threshold {item!r}: {command} has no threshold {name!r}",
                f"{model.__name__} fields: {', '.join(fields)}",
            )
        values[name] = value
    try:
        return model.model_validate(values)
    except ValidationError as e:
        e0 = e.errors()[0]
        field = str(e0["loc"][0]) if e0.get("loc") else "?"
        _fail(f"--threshold {field}={values.get(field, '')}: {e0['msg']}")


_CHECKS_HELP = (
    "module (dotted name or .py file) whose @check functions to run too; repeatable "
    "(installed entry points of traintape.checks always run)"
)


_THRESHOLD_HELP = (
    "NAME=VALUE: override one of the {model} fields (repeatable; `traintape {cmd} "
    "--threshold x=1` lists the names); see the {model} docstring for their meaning"
)


def _window_arg(window: str | None) -> int | None:
    """``--window``: None, a step count ≥ 1, or ``auto`` (returned as 0)."""
    if window is None:
        return None
    if window.strip().lower() == "auto":
        return 0
    try:
        n = int(window)
    except ValueError:
        _fail(f"--window must be a number of steps or 'auto', got {window!r}")
    if n < 1:
        _fail(f"--window must be at least 1 step, got {n}")
    return n


@app.command()
def health(
    run: str = typer.Argument(..., help="run directory or URL"),
    window: str | None = typer.Option(
        None,
        "--window",
        "-w",
        help="health per window of N steps: how each layer's status evolves (auto: "
        "windows sized to the run's length)",
    ),
    against: str | None = typer.Option(
        None, "--against", help="baseline run: is RUN improved, degraded or unchanged, per layer?"
    ),
    threshold: list[str] | None = typer.Option(
        None,
        "--threshold",
        "-t",
        help=_THRESHOLD_HELP.format(model="HealthThresholds", cmd="health"),
        show_default=False,
    ),
    checks: list[str] | None = typer.Option(
        None, "--checks", help=_CHECKS_HELP, show_default=False
    ),
    as_json: bool = typer.Option(False, "--json", help="machine-readable output"),
) -> None:
    """Gradient-flow health per layer: score, status, issues and recommendations.

    With --window N: each layer's status per window of N steps (windows aligned to
    multiples of N; --window auto: sized to the run), where it changed, and the issues of each stretch of windows, with
    turbulence, max pressure and grad-norm velocity/acceleration. With --against B: per
    layer, RUN improved / degraded / unchanged against the baseline B, with the issues
    resolved or new and the measures that moved (from B's value to RUN's).

    Checks registered in traintape.analysis.registry (@check in a module given with
    --checks, or installed under the entry-point group traintape.checks) are run and
    listed after the table; their critical issues count like a layer's, a check that
    fails is shown as failed.

    Exit code 0 unless a layer is critical (1; with --window: in any window); with
    --against, 1 when a layer degraded; 2 on bad input.
    """
    from traintape.analysis import HealthThresholds
    from traintape.analysis import health as run_health

    steps_per_window = _window_arg(window)
    if steps_per_window is not None and against is not None:
        _fail("--window and --against cannot be combined", "run them one after the other")
    th = _thresholds(HealthThresholds, threshold, "health")
    _import_checks(checks)
    r = _open(run)
    if steps_per_window is not None:
        if steps_per_window == 0:  # auto
            from traintape.analysis.health_trend import default_window

            min_rows = (th or HealthThresholds()).trend_min_rows
            steps_per_window = default_window(r.steps, min_rows=min_rows)
        _health_trend(r, run, steps_per_window, as_json, th)
    if against is not None:
        _health_against(r, run, _open(against), against, as_json, th)
    with _reading(run), _progress("health") as cb:
        rep = run_health(r, th, progress=cb)
    if as_json:
        _json_out(rep)
        raise typer.Exit(1 if rep.status == "critical" else 0)
    console.print(
        f"[bold]{_safe(r.url)}[/bold]: {rep.steps} steps, {len(rep.layers)} layers — "
        f"{_status(rep.status)}, score {rep.score:.0f}/100"
    )
    _health_table(rep)
    _checks_table(rep.checks)
    raise typer.Exit(1 if rep.status == "critical" else 0)


@app.command("anomalies")
def anomalies_cmd(
    run: str = typer.Argument(..., help="run directory or URL"),
    as_json: bool = typer.Option(False, "--json", help="machine-readable output"),
    limit: int = typer.Option(50, help="rows shown (the JSON has all)"),
    threshold: list[str] | None = typer.Option(
        None,
        "--threshold",
        "-t",
        help=_THRESHOLD_HELP.format(model="AnomalyThresholds", cmd="anomalies"),
        show_default=False,
    ),
) -> None:
    """NaN/Inf first seen, loss and gradient spikes, update ratios, dead units, stalls."""
    from traintape.analysis import AnomalyThresholds
    from traintape.analysis import anomalies as run_anomalies

    th = _thresholds(AnomalyThresholds, threshold, "anomalies")
    r = _open(run)
    with _reading(run), _progress("anomalies") as cb:
        rep = run_anomalies(r, th, progress=cb)
    if as_json:
        _json_out(rep)
        return
    console.print(f"anomalies: {_safe(rep.summary())}", highlight=False, soft_wrap=True)
    if rep.first_nonfinite is not None:
        a = rep.first_nonfinite
        console.print(
            f"[red]first non-finite value:[/red] step {a.step}, "
            f"{a.kind.value if a.kind else 'metric'} {a.tensor}"
        )
    if not rep.anomalies:
        console.print(f"[green]no anomalies[/green] in {r.url}")
        return
    t = Table(
        "step", "type", "severity", "kind",
        _name_column("tensor / layer", [a.tensor or a.layer or "" for a in rep.anomalies[:limit]]),
        Column("message", overflow="fold"),
    )  # fmt: skip
    sev = {"error": "red", "warning": "yellow", "info": "cyan"}
    for a in rep.anomalies[:limit]:
        c = sev[a.severity.value]
        t.add_row(
            str(a.step), a.type, f"[{c}]{a.severity.value}[/{c}]", a.kind.value if a.kind else "",
            a.tensor or a.layer or "", a.message,
        )  # fmt: skip
    console.print(t)
    if len(rep.anomalies) > limit:
        console.print(f"... {len(rep.anomalies) - limit} more (use --limit or --json)")


def _float_list(values: list[str] | None, option: str) -> list[float]:
    """Comma-separated and/or repeated non-negative numbers of ``option``; exits 2 naming
    the one that is not."""
    import math

    out: list[float] = []
    for v in values or []:
        for part in v.split(","):
            part = part.strip()
            if not part:
                continue
            try:
                x = float(part)
            except ValueError:
                _fail(f"{option} {part!r}: not a number", f"e.g. {option} 1e-3,1e-2")
            if not math.isfinite(x) or x < 0:
                _fail(f"{option} {part!r}: must be a finite number >= 0")
            out.append(x)
    return out


def _change_row(name: str, c: Any, thr: list[str]) -> list[str]:
    f = lambda v: "–" if v is None else f"{v:.3g}"  # noqa: E731
    return [
        _safe(name), str(c.numel), f(c.l1), f(c.l2), f(c.relative), f(c.max), f(c.mean),
        f(c.std), *(f"{c.sparsity[t]:.1%}" for t in thr),
    ]  # fmt: skip


@app.command()
def change(
    run: str = typer.Argument(..., help="run directory or URL (with param snapshots)"),
    step_old: int | None = typer.Option(None, "--from", help="θ_old snapshot step [first]"),
    step_new: int | None = typer.Option(None, "--to", help="θ_new snapshot step [last]"),
    thresholds: list[str] | None = typer.Option(
        None,
        "--thresholds",
        help="|Δ| thresholds of the sparsity columns, comma-separated [1e-8,1e-6,1e-4]",
        show_default=False,
    ),
    limit: int = typer.Option(50, min=1, help="layers shown (the JSON has all)"),
    as_json: bool = typer.Option(False, "--json", help="machine-readable output"),
) -> None:
    """Parameter change between two snapshot steps: Δ = θ(--to) − θ(--from).

    Per layer, per component (attention q/k/v/o, mlp, embedding, norm, lora/...) and in
    total: ‖Δ‖₁, ‖Δ‖₂, ‖Δ‖₂/‖θ_old‖₂, max |Δ|, mean and std of Δ, and the fraction of
    entries with |Δ| <= each threshold (sparsity). LoRA runs also get each adapter's
    effective update ΔW = s·A·B and how far it moved. Needs full param snapshots
    (CapturePolicy(full_every=N)); --from/--to default to the first and last.
    """
    from traintape.analysis import parameter_change
    from traintape.analysis.change import DEFAULT_THRESHOLDS, param_snapshot_steps

    thr = tuple(sorted(set(_float_list(thresholds, "--thresholds")))) or DEFAULT_THRESHOLDS
    r = _open(run)
    with _reading(run):
        steps = param_snapshot_steps(r)
    snaps = set(steps)
    if len(steps) < 2:
        _fail(
            f"{run}: needs param snapshots at two steps, found {len(steps)}",
            "record with CapturePolicy(full_every=N) to keep full parameter snapshots",
        )
    shown = ", ".join(map(str, steps[:20])) + (" ..." if len(steps) > 20 else "")
    for opt, s in (("--from", step_old), ("--to", step_new)):
        if s is not None and s not in snaps:
            _fail(f"{opt} {s}: {run} has no param snapshot at step {s}", f"snapshot steps: {shown}")
    a = steps[0] if step_old is None else step_old
    b = steps[-1] if step_new is None else step_new
    if a >= b:
        _fail(f"--from {a} must be before --to {b}", f"snapshot steps: {shown}")
    with _reading(run), _progress("parameter change") as cb:
        pc = parameter_change(r, thr, steps=(a, b), progress=cb)
    if as_json:
        _json_out(pc)
        return
    p = pc.pairs[0]
    keys = [f"{t:g}" for t in pc.thresholds]
    console.print(
        f"[bold]{_safe(r.url)}[/bold]: Δ = θ(step {b}) − θ(step {a}), "
        f"{len(p.per_tensor)} param tensors in {len(p.per_layer)} layers",
        highlight=False,
    )
    from rich import box

    heads = [Column(h, justify="right", no_wrap=True) for h in (
        "numel", "‖Δ‖₁", "‖Δ‖₂", "‖Δ‖/‖θ‖", "max |Δ|", "mean Δ", "std Δ",
        *(f"≤{k}" for k in keys),
    )]  # fmt: skip
    note = "≤t: the share of entries with |Δ| ≤ t"
    t = Table(_name_column("component", [*p.per_component, "total"]), *heads,
              title="per component", box=box.SIMPLE_HEAD, caption=note)  # fmt: skip
    comps = list(p.per_component.items())
    for n, (name, c) in enumerate(comps):
        t.add_row(*_change_row(name, c, keys), end_section=n == len(comps) - 1)
    t.add_row(*_change_row("total", p.total, keys), style="bold")
    console.print(t)
    layers = list(p.per_layer.items())
    t = Table(_name_column("layer", [x for x, _ in layers[:limit]], cap=40), *heads,
              title="per layer", box=box.SIMPLE_HEAD, caption=note)  # fmt: skip
    for name, c in layers[:limit]:
        t.add_row(*_change_row(name, c, keys))
    console.print(t)
    if len(layers) > limit:
        console.print(f"... {len(layers) - limit} more layers (use --limit or --json)")
    if p.lora:
        f = lambda v: "–" if v is None else f"{v:.3g}"  # noqa: E731
        t = Table(
            _name_column("adapter", list(p.lora), cap=40), "‖ΔW_old‖", "‖ΔW_new‖",
            "‖ΔW_new − ΔW_old‖", "/‖W_base‖", "effective rank",
            title="LoRA effective update ΔW = s·A·B",
        )  # fmt: skip
        for k, x in list(p.lora.items())[:limit]:
            t.add_row(_safe(k), f(x.norm_old), f(x.norm), f(x.change), f(x.relative),
                      f(x.effective_rank))  # fmt: skip
        console.print(t)
        if pc.lora is not None and not pc.lora.scale_known:
            console.print(
                "[dim]the run does not record PEFT's scale s (lora_alpha / r): ΔW is up to s[/dim]"
            )


@app.command()
def report(
    run: str = typer.Argument(..., help="run directory or URL"),
    out: str | None = typer.Option(
        None,
        "--out",
        "-o",
        help="file to write [html: report.html; md: standard output]",
        show_default=False,
    ),
    fmt: str = typer.Option(
        "html", "--format", "-f", help="html (a self-contained page) or md (Markdown)"
    ),
    checks: list[str] | None = typer.Option(
        None, "--checks", help=_CHECKS_HELP, show_default=False
    ),
    tensors: str | None = typer.Option(
        None,
        "--tensors",
        help="GLOB of the tensors whose grad/param value distributions over time the HTML "
        "report draws from snapshots (default: the kernels)",
        show_default=False,
    ),
) -> None:
    """Write one self-contained HTML report (figures embedded, sortable tables, a detail
    per layer; no network needed), or with --format md a Markdown summary — run info,
    health table, checks, anomalies, largest parameter changes — to paste into an issue
    tracker (printed unless --out is given)."""
    from traintape.analysis import render_markdown, write_report

    if fmt not in ("html", "md"):
        _fail(f"unknown report format {fmt!r}: use html or md")
    if fmt == "html" and out is None:
        out = "report.html"
    if out is not None:
        parent = os.path.dirname(os.path.abspath(out))
        if not os.path.isdir(parent):
            _fail(f"cannot write {out}: directory {parent} does not exist")
    _import_checks(checks)
    r = _open(run)
    if fmt == "md":
        with _reading(run), _progress("report") as cb:
            text = render_markdown(r, progress=cb)
        if out is None:
            sys.stdout.write(text)
            return
        with open(out, "w", encoding="utf-8") as f:
            f.write(text)
    else:
        assert out is not None
        with _reading(run), _progress("report") as cb:
            write_report(r, out, progress=cb, tensors=tensors)
    console.print(f"wrote {out} ({_human(os.path.getsize(out))})")


@app.command()
def monitor(
    run: str = typer.Argument(..., help="run directory or URL being written"),
    interval: float = typer.Option(1.0, help="seconds between refreshes"),
    once: bool = typer.Option(False, "--once", help="print one view and exit"),
    max_seconds: float | None = typer.Option(None, "--max-seconds", help="stop after this long"),
    wait: float = typer.Option(
        0.0, "--wait", help="seconds to wait for the run to appear (start before training)"
    ),
) -> None:
    """Follow a run while another process writes it (committed rows only)."""
    import time

    from rich.live import Live

    from traintape.analysis.change import last_row_change

    if wait > 0 and _store_problem(run) is not None:
        deadline = time.monotonic() + wait
        with console.status(f"waiting for a run at {run} (up to {wait:g} s)"):
            while _store_problem(run) is not None and time.monotonic() < deadline:
                time.sleep(min(interval, 0.2))
    r = _open(run)  # still missing after --wait: exits 2 naming the path

    def view() -> Table:
        try:
            return _view()
        except Exception as e:  # a damaged store: say so instead of a traceback
            t = Table(title=f"{_safe(r.url)} · unreadable")
            t.add_column("problem")
            t.add_row(f"[red]{_safe(type(e).__name__)}: {_safe(e)}[/red]")
            t.add_row(f"`traintape validate {_safe(run)}` lists what is damaged")
            failed.append(e)
            return t

    failed: list[BaseException] = []

    def _view() -> Table:
        r.refresh()
        m = r.manifest
        st = r.steps
        t = Table(title=f"{_safe(r.url)} · {_safe(m.status)} · {r.rows} rows · last step "
                        f"{int(st[-1]) if len(st) else '–'} · {len(m.events)} events")  # fmt: skip
        t.add_column("layer / metric")
        t.add_column("grad norm: last step")
        t.add_column("update/param: last step")
        t.add_column("metric: last logged")
        if r.rows:
            met = r.metrics()
            for c in met.columns:
                col = met[c].dropna()
                t.add_row(
                    f"[bold]{_safe(c)}[/bold]", "", "", f"{col.iloc[-1]:.6g}" if len(col) else "–"
                )
            for layer, g, ratio in last_row_change(r):
                t.add_row(_safe(layer), "–" if g is None else f"{g:.3g}",
                          "–" if ratio is None else f"{ratio:.3g}", "")  # fmt: skip
        return t

    if once:
        console.print(view())
        if failed:
            raise typer.Exit(1)
        return
    start = time.monotonic()
    with Live(view(), console=console, refresh_per_second=4) as live:
        while True:
            if max_seconds is not None and time.monotonic() - start >= max_seconds:
                break
            time.sleep(interval)
            live.update(view())
            if r.manifest.status != "open":
                break


@app.command("export")
def export_cmd(
    run: str = typer.Argument(..., help="run directory or URL"),
    dest: str | None = typer.Argument(
        None, metavar="[DIR]", help="where to write (the same as --out)", show_default=False
    ),
    out: str | None = typer.Option(
        None, "--out", "-o", help="directory (parquet/csv/tensorboard/wandb) or .npz file"
    ),
    to: str | None = typer.Option(
        None, "--to", "-t", help="parquet, csv, npz, tensorboard or wandb", show_default=False
    ),
    fmt: str | None = typer.Option(
        None, "--format", "-f", help="the same as --to (default parquet)", show_default=False
    ),
    snapshots: bool = typer.Option(False, "--snapshots", help="npz: include full snapshots"),
    kinds: list[str] | None = typer.Option(
        None,
        "--kind",
        "-k",
        help="tensorboard/wandb: kinds to export (repeat or comma-separate; default all)",
        show_default=False,
    ),
    stats: str = typer.Option(
        "l2,mean,std,max,min",
        "--stats",
        help="tensorboard/wandb: stats per tensor, comma-separated",
    ),
    histograms: bool = typer.Option(
        True, "--histograms/--no-histograms", help="tensorboard/wandb: histograms of snapshots"
    ),
    bins: int = typer.Option(30, "--bins", min=1, max=512, help="tensorboard/wandb: buckets"),
    project: str = typer.Option("traintape", "--project", help="wandb: project name"),
    overwrite: bool = typer.Option(
        False, "--overwrite", help="tensorboard: replace an earlier traintape export in DIR"
    ),
) -> None:
    """Export stats and metrics to parquet, csv or npz, or to TensorBoard / W&B.

    `traintape export RUN --to tensorboard DIR` writes an event file (`tensorboard --logdir
    DIR`); `--to wandb DIR` an offline W&B run (`wandb sync` uploads it). Both get scalars
    <kind>/<tensor>/<stat>, the metrics and sys/ metrics at their optimizer steps, and
    histograms <kind>/<tensor>/histogram at snapshot steps.
    """
    from traintape.schema import STAT_NAMES

    targets = ("parquet", "csv", "npz", "tensorboard", "wandb")
    if to is not None and fmt is not None and to != fmt:
        _fail(f"--to {to} and --format {fmt} disagree: give one of them")
    target = to or fmt or "parquet"
    if target not in targets:
        _fail(f"unknown format {target!r}: use {', '.join(targets[:-1])} or {targets[-1]}")
    if dest is not None and out is not None and dest != out:
        _fail(f"two destinations: {dest} and --out {out}: give one of them")
    where = dest or out
    if where is None:
        _fail(
            "no destination: give DIR after RUN or --out",
            f"e.g. traintape export {run} --to {target} "
            + ("out.npz" if target == "npz" else f"{target}_out"),
        )
    bridge = target in ("tensorboard", "wandb")
    if bridge:
        from traintape.analysis.bridges import MissingDependencyError, require

        try:  # before opening the run: say at once which package is missing
            require(target)
        except MissingDependencyError as e:
            _fail(str(e))
    r = _open(run)
    parent = os.path.dirname(os.path.abspath(where))
    if not os.path.isdir(parent):
        _fail(f"cannot write {where}: directory {parent} does not exist")
    if not bridge:
        from traintape.analysis import export

        with _reading(run), _progress(f"export {target}") as cb:
            paths = export(r, where, target, snapshots=snapshots, progress=cb)  # type: ignore[arg-type]
        for p in paths:
            console.print(f"wrote {p}")
        return
    have = [k.value for k in r.kinds()]
    chosen = [k.strip() for v in kinds or [] for k in v.split(",") if k.strip()] or None
    for k in chosen or []:
        if k not in have:
            _fail(f"kind {k!r} is not in {run}: use {', '.join(have) or '(none)'}")
    stat_list = [s.strip() for s in stats.split(",") if s.strip()]
    for s in stat_list:
        if s not in STAT_NAMES:
            _fail(f"unknown stat {s!r}: use any of {', '.join(STAT_NAMES)}")
    opts: dict[str, Any] = dict(kinds=chosen, stats=stat_list, histograms=histograms, bins=bins)
    if target == "tensorboard":
        from traintape.analysis.bridges import check_logdir, export_tensorboard

        try:
            check_logdir(where, overwrite=overwrite)
        except FileExistsError as e:
            _fail(str(e))
        with _reading(run), _progress("export tensorboard") as cb:
            path = export_tensorboard(r, where, overwrite=overwrite, progress=cb, **opts)
        console.print(f"wrote {path}")
        console.print(f"view it with: tensorboard --logdir {where}", highlight=False)
    else:
        from traintape.analysis.bridges import export_wandb

        with _reading(run), _progress("export wandb") as cb:
            path = export_wandb(r, where, project=project, progress=cb, **opts)
        console.print(f"wrote {path} (an offline W&B run)")
        console.print(f"upload it with: wandb sync {path}", highlight=False)


@app.command()
def rm(
    run: str = typer.Argument(..., help="run directory or URL"),
    yes: bool = typer.Option(False, "--yes", "-y", help="do not ask"),
) -> None:
    """Delete a run store: exactly what its manifest (and its rewind copies') vouches for
    — arrays, groups, manifest, writer claim; anything else, even inside the store's
    directories, is left where it is, and listed."""
    from traintape.core.kvstore import KvStore, local_path, normalize_url
    from traintape.core.remove import store_keys_to_delete

    path = local_path(normalize_url(run))
    if path is not None and os.path.islink(path.rstrip("/")):
        target = os.path.realpath(path)
        _fail(
            f"{run} is a symbolic link to {target}",
            f"run `traintape rm {target}` to delete the store",
        )
    r = _open(run, check=False)  # a damaged store can be removed too
    desc = f"{escape(r.url)} ({r.rows} rows, {r.manifest.status})"
    if not yes and not typer.confirm(f"delete run {r.url} ({r.rows} rows, {r.manifest.status})?"):
        console.print("not deleted")
        raise typer.Exit(1)
    kv = KvStore(r.url)
    ours, foreign = store_keys_to_delete(kv, r.manifest, r.url)  # what the manifests vouch for
    for key in sorted(ours, key=lambda k: k.endswith("zarr.json")):  # manifests last
        kv.delete(key)
    if path is not None:  # the file driver leaves directories: remove the empty ones
        for root, dirs, _files in os.walk(path, topdown=False):
            for d in dirs:
                with contextlib.suppress(OSError):
                    os.rmdir(os.path.join(root, d))
        with contextlib.suppress(OSError):
            os.rmdir(path)
    console.print(f"deleted {desc}")
    if foreign:
        shown = ", ".join(escape(k) for k in foreign[:10]) + (" ..." if len(foreign) > 10 else "")
        console.print(f"left {len(foreign)} entries that are not part of the store: {shown}")


@app.command()
def compare(
    run_a: str = typer.Argument(..., help="first run"),
    run_b: str = typer.Argument(..., help="second run (relative errors are relative to it)"),
    atol: float | None = typer.Option(None, help="absolute tolerance for every kind"),
    rtol: float | None = typer.Option(None, help="relative tolerance for every kind"),
    no_snapshots: bool = typer.Option(False, "--no-snapshots", help="compare stats only"),
    as_json: bool = typer.Option(False, "--json", help="machine-readable output"),
    show: int = typer.Option(20, help="tensors shown in the table"),
    strict: bool = typer.Option(
        False, "--strict", help="the stores must also be identical in structure"
    ),
    exclude: list[str] = typer.Option(
        [], "--exclude", help="leave out tensors/metrics matching this glob (repeatable)"
    ),
    precision: str | None = typer.Option(
        None,
        "--precision",
        help="bf16, fp16, tf32, fp32 or fp64: tolerances from the format's unit roundoff and "
        "the step count (default: what the stores record, else the fixed defaults)",
    ),
    explain: bool = typer.Option(
        False, "--explain", help="print the rules and the numbers used per kind"
    ),
) -> None:
    """Compare two runs: by default the data both hold (kinds, tensors and steps in one run
    only are listed as not compared; metadata differences are notes); with --strict the
    structure too. Scale-free statistics are judged only above a tensor's noise floor; a
    tensor within noise in both runs is equal (see docs/compare.md, or --explain).

    Exit code 0 when identical, 1 when they differ, 2 when a store cannot be read.
    """
    from traintape.analysis import compare as run_compare
    from traintape.analysis.compare_numerics import normalise_precision

    if precision is not None:
        try:
            precision = normalise_precision(precision)
        except ValueError as e:
            _fail(f"--precision: {e}")
    ra, rb = _open(run_a), _open(run_b)
    with _reading(run_a, run_b), _progress("compare") as cb:
        rep = run_compare(
            ra, rb, atol=atol, rtol=rtol, snapshots=not no_snapshots, progress=cb,
            strict=strict, exclude=exclude, precision=precision,
        )  # fmt: skip
    if as_json:
        _json_out(rep)
        raise typer.Exit(0 if rep.identical else 1)
    _print_compare(rep, show, explain)
    raise typer.Exit(0 if rep.identical else 1)


def _print_compare(rep: Any, show: int, explain: bool) -> None:
    c = "green" if rep.identical else "red"
    judged = "strict: data and structure" if rep.mode == "strict" else "shared data only"
    console.print(
        f"[{c}][bold]{rep.verdict}[/bold][/{c}] ({judged}): {escape(rep.a)} vs {escape(rep.b)} "
        f"({rep.common_steps} common steps)"
    )
    p = rep.precision
    if p is not None:
        console.print(
            f"  precision {p.mode or 'default'} (u = {p.unit_roundoff:.3g}, {escape(p.source)}); "
            + "; ".join(
                f"{k} noise floor {v.noise_floor[0]:.2g}..{v.noise_floor[1]:.2g}"
                for k, v in rep.numerics.items()
                if v.noise_floor is not None
            )
        )
    for s in rep.structural:
        console.print(f"  [red]structure[/red] {escape(s.message)}")
    for s in rep.not_compared[:10]:
        console.print(f"  [yellow]not compared[/yellow] {escape(s.message)}")
    if len(rep.not_compared) > 10:
        from collections import Counter

        more = Counter(f"{s.what} {s.field}" if s.field else s.what for s in rep.not_compared[10:])
        shown = ", ".join(f"{n} {w}" for w, n in more.most_common())
        console.print(f"  [yellow]not compared[/yellow] ... {len(rep.not_compared) - 10} more "
                      f"({escape(shown)}; --json lists them)")  # fmt: skip
    if rep.excluded:
        console.print(f"  [dim]excluded: {escape(', '.join(rep.excluded))}[/dim]")
    for n in rep.notes:
        console.print(f"  [dim]note: {escape(n)}[/dim]")
    within = [f"{k}: {', '.join(v.tensors_within_noise)}" for k, v in rep.numerics.items()
              if v.tensors_within_noise]  # fmt: skip
    if within:
        console.print(
            f"  [dim]within noise at some step (equal there): {escape('; '.join(within))}[/dim]"
        )
    if rep.first_divergence is not None:
        d = rep.first_divergence
        g = lambda v: "–" if v is None else f"{v:.4g}"  # noqa: E731
        console.print(
            f"  first divergence: [bold]{d.kind} {escape(d.tensor)}[/bold] at step "
            f"{d.first_step_out} (via {d.first_out_via}: {g(d.first_out_a)} vs "
            f"{g(d.first_out_b)}, allowed |a - b| <= {g(d.first_out_tol)})"
        )
    if explain:
        for line in rep.explain:
            console.print(f"  [cyan]{escape(line)}[/cyan]")
    _compare_table(rep, show)


def _compare_table(rep: Any, show: int) -> None:
    from traintape.analysis._common import KIND_RANK

    bad = [t for t in rep.tensors if not t.within]
    order = {k.value: r for k, r in KIND_RANK.items()}
    bad.sort(key=lambda t: (t.first_step_out or 0, order.get(t.kind, 9), t.tensor))
    rows = bad[:show] if bad else sorted(rep.tensors, key=lambda t: -(t.max_tol_ratio or 0))[:show]
    t = Table(
        "kind", _name_column("tensor", [d.tensor for d in rows]), "steps", "snaps",
        "max abs (stat)", "max rel (stat)", "worst/tol (stat)", "min cos", "first out (via)",
        "noise floor",
    )  # fmt: skip
    f = lambda v: "–" if v is None else f"{v:.3g}"  # noqa: E731
    w = lambda v, s: "–" if v is None else f"{v:.3g} ({s})"  # noqa: E731
    for d in rows:
        out = f"[red]{d.first_step_out} ({d.first_out_via})[/red]" if not d.within else "–"
        floor = f(d.noise_floor) + (f" [{d.steps_within_noise} in]" if d.steps_within_noise else "")
        t.add_row(
            d.kind, d.tensor, str(d.steps_compared), str(d.snapshots_compared),
            w(d.max_abs, d.worst_stat), w(d.max_rel, d.max_rel_stat),
            w(d.max_tol_ratio, d.max_tol_ratio_stat), f(d.min_cosine), out, floor,
        )  # fmt: skip
    if rows:
        t.title = "out of tolerance" if bad else "closest to tolerance (all within: worst/tol <= 1)"
        console.print(t)
    if len(bad) > show:
        console.print(f"... {len(bad) - show} more out of tolerance (use --show or --json)")


# ----------------------------------------------------------------- sparse-update quality


def _load_object(spec: str, what: str) -> Any:
    """``MODULE:ATTR`` (a dotted module importable from the current directory, or a path
    to a ``.py`` file) → the object; ATTR may be dotted. Exits 2 with a message if not."""
    mod_name, sep, attr = spec.rpartition(":")
    if not sep or not mod_name or not attr:
        _fail(f"{what} {spec!r}: expected MODULE:ATTR, e.g. mymodel:forward or path/to/m.py:model")
    obj: Any = _import_module(mod_name, spec, what)
    for part in attr.split("."):
        if not hasattr(obj, part):
            _fail(f"{what} {spec!r}: {mod_name} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj


def _import_module(mod_name: str, spec: str, what: str) -> Any:
    """Import ``mod_name``: a dotted module importable from the current directory, or a
    path to a ``.py`` file. Exits 2 naming ``what`` and ``spec`` if it cannot."""
    try:
        if mod_name.endswith(".py") or os.sep in mod_name:
            path = os.path.abspath(mod_name)
            if not os.path.isfile(path):
                _fail(f"{what} {spec!r}: no such file {path}")
            name = "_traintape_user_" + Path(path).stem
            loader_spec = importlib.util.spec_from_file_location(name, path)
            assert loader_spec is not None and loader_spec.loader is not None
            module = importlib.util.module_from_spec(loader_spec)
            sys.modules[name] = module
            sys.path.insert(0, os.path.dirname(path))
            try:
                loader_spec.loader.exec_module(module)
            finally:
                sys.path.remove(os.path.dirname(path))
        else:
            if os.getcwd() not in sys.path:
                sys.path.insert(0, os.getcwd())
            module = importlib.import_module(mod_name)
    except typer.Exit:
        raise
    except Exception as e:
        _fail(f"{what} {spec!r}: cannot import {mod_name}: {type(e).__name__}: {e}")
    return module


def _import_checks(specs: list[str] | None) -> None:
    """``--checks``: import each module (dotted name or ``.py`` path) so that its
    ``@check`` decorators register its checks; exits 2 if one cannot be imported."""
    for spec in specs or []:
        _import_module(spec, spec, "--checks")


def _load_inputs(spec: str) -> Any:
    """``--inputs``: a ``.npy``/``.npz`` file (several npz arrays → a tuple, in file order)
    or ``MODULE:ATTR`` (a value, or a callable taking no arguments that returns it)."""
    import numpy as np

    if spec.endswith((".npy", ".npz")) and ":" not in os.path.basename(spec):
        if not os.path.isfile(spec):
            _fail(f"--inputs {spec!r}: no such file")
        data = np.load(spec)
        if spec.endswith(".npy"):
            return data
        arrays = [data[k] for k in data.files]
        return arrays[0] if len(arrays) == 1 else tuple(arrays)
    obj = _load_object(spec, "--inputs")
    return obj() if callable(obj) else obj


@app.command("sparse-update")
def sparse_update(
    run: str = typer.Argument(..., help="run directory or URL (with param snapshots)"),
    forward: str = typer.Option(
        ...,
        "--forward",
        "-m",
        "--model",
        help="MODULE:ATTR of forward(params, inputs) on {canonical name: array}, "
        "or of a torch.nn.Module (instance, or class built with no arguments)",
    ),
    inputs: str = typer.Option(
        ...,
        "--inputs",
        "-i",
        help="probe batch: MODULE:ATTR (value or no-argument callable), .npy or .npz file",
    ),
    step_old: int | None = typer.Option(None, "--from", help="θ_old snapshot step [first]"),
    step_new: int | None = typer.Option(None, "--to", help="θ_new snapshot step [last]"),
    threshold: list[float] | None = typer.Option(
        None, "--threshold", "-t", help="|Δ| threshold, repeatable [1e-8, 1e-6, 1e-4]"
    ),
    seed: int = typer.Option(0, help="seed of the random masks"),
    as_json: bool = typer.Option(False, "--json", help="machine-readable output"),
) -> None:
    """Would a sparse update have done the same? Outputs of θ_old + Δ vs θ_old + masked Δ.

    Δ = θ_new − θ_old from two param snapshots. For each threshold the update is masked to
    the entries with |Δ| > threshold ("magnitude") and, as a control, to a random set of
    the same size per tensor ("random"); the outputs on the probe batch are compared with
    those of the full update: KL of the softmax over the last axis, cosine, MSE, top-1
    agreement, and the fraction of Δ kept.
    """
    from traintape.analysis import sparse_update_from_run
    from traintape.analysis.change import DEFAULT_THRESHOLDS
    from traintape.analysis.sparse import is_torch_module, snapshot_pair_steps

    r = _open(run)
    with _reading(run):
        steps = snapshot_pair_steps(r)
    if len(steps) < 2:
        _fail(
            f"{run}: needs param snapshots at two steps, found {len(steps)}",
            "record with CapturePolicy(full_every=N) to keep full parameter snapshots",
        )
    for s in (step_old, step_new):
        if s is not None and s not in steps:
            shown = ", ".join(map(str, steps[:20])) + (" ..." if len(steps) > 20 else "")
            _fail(f"{run}: no param snapshot at step {s}", f"snapshot steps: {shown}")
    model = _load_object(forward, "--forward")
    if inspect.isclass(model):
        try:
            model = model()
        except Exception as e:
            _fail(f"--forward {forward!r}: cannot build {model.__name__}(): {e}")
    if is_torch_module(model):
        from traintape.torch import as_forward

        model = as_forward(model)
    if not callable(model):
        _fail(f"--forward {forward!r} is neither a callable nor a torch.nn.Module")
    batch = _load_inputs(inputs)
    thresholds = tuple(threshold) if threshold else DEFAULT_THRESHOLDS
    try:
        with _progress("sparse update") as cb:
            q = sparse_update_from_run(
                r, model, batch, step_old, step_new, thresholds, seed=seed, progress=cb
            )
    except (typer.Exit, KeyboardInterrupt):
        raise
    except Exception as e:
        if os.environ.get("TRAINTAPE_DEBUG"):
            raise
        _fail(
            f"sparse-update on {run} failed: {type(e).__name__}: {e}",
            "the forward gets {canonical name: array} in canonical layout (or a torch module "
            "its own parameters); TRAINTAPE_DEBUG=1 shows a traceback",
        )
    if as_json:
        _json_out(q)
        return
    console.print(
        f"[bold]{r.url}[/bold]: Δ = θ(step {q.step_new}) − θ(step {q.step_old}), "
        f"{q.tensors} param tensors"
    )
    b = q.baseline
    console.print(
        f"no update at all: KL {b.kl:.3g}, cosine {b.cosine:.4f}, top-1 {b.top1:.3f}",
        highlight=False,
    )
    t = Table(
        "|Δ| >", "mask", "kept", "KL", "cosine", "MSE", "top-1",
        title="magnitude mask vs a random mask of the same size",
    )  # fmt: skip
    for thr in q.thresholds:
        for variant in ("magnitude", "random"):
            x = q.result(variant, thr)
            t.add_row(
                f"{thr:g}" if variant == "magnitude" else "", variant, f"{x.kept:.1%}",
                f"{x.kl:.3g}", f"{x.cosine:.6f}", f"{x.mse:.3g}", f"{x.top1:.3f}",
            )  # fmt: skip
    console.print(t)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
