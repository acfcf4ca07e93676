"""The ``traintape`` command line."""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

app = typer.Typer(
    help="traintape: record, validate, compare and analyse neural-network training runs.",
    no_args_is_help=True,
    add_completion=False,
)
console = Console()
err = Console(stderr=True)


def _open(run: str):
    from traintape.core import NotAStoreError, open_run
    from traintape.schema import SchemaVersionError

    try:
        return open_run(run)
    except (NotAStoreError, SchemaVersionError) as e:
        err.print(f"[red]error:[/red] {e}")
        raise typer.Exit(2) from None


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
) -> None:
    """Check a store: manifest, arrays, steps, commit mark, every chunk's checksum.

    Exit code 0 when valid, 1 with one line per problem otherwise.
    """
    from traintape.core import validate as run_validate

    report = run_validate(run)
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


@app.command()
def show(run: str = typer.Argument(..., help="run directory or URL")) -> None:
    """Summarise a run: producer, policy, steps, tensors per kind, metrics, events."""
    r = _open(run)
    m = r.manifest
    p = m.producer
    console.print(f"[bold]{r.url}[/bold]  run {m.run_id}  status [cyan]{m.status}[/cyan]")
    console.print(
        f"schema {m.schema_version} · producer {p.framework or 'numpy'} "
        f"{p.framework_version or ''} ({p.adapter or 'Recorder'}) · traintape {p.traintape_version}"
    )
    steps = r.steps
    span = f"{int(steps[0])}..{int(steps[-1])}" if len(steps) else "none"
    console.print(f"{r.rows} rows (steps {span}) · policy {m.policy.model_dump(mode='json')}")
    t = Table("kind", "tensors", "snapshots", "example")
    for kind in r.kinds():
        names = r.tensor_names(kind)
        t.add_row(kind.value, str(len(names)), str(m.commit.snapshots.get(kind, 0)), names[0])
    console.print(t)
    met = r.metrics()
    if len(met.columns):
        mt = Table("metric", "last step", "last value", "min", "max")
        for c in met.columns:
            col = met[c].dropna()
            if len(col):
                mt.add_row(
                    c,
                    str(col.index[-1]),
                    f"{col.iloc[-1]:.6g}",
                    f"{col.min():.6g}",
                    f"{col.max():.6g}",
                )
        console.print(mt)
    if m.events:
        console.print(f"[yellow]{len(m.events)} events[/yellow]")
        for e in m.events[:20]:
            console.print(f"  step {e.step} [{e.severity.value}] {e.type}: {e.message}")
    w = m.writer
    console.print(
        f"writer: {w.commits} commits, {w.stalls} stalls ({w.stall_seconds:.3f} s)"
        + (f", [red]disabled: {w.error}[/red]" if w.disabled else "")
    )


# ---------------------------------------------------------------------------- analysis


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


def _find_stores(root: str, depth: int = 3) -> list[str]:
    out = []
    root = os.path.abspath(root)
    base = root.rstrip(os.sep).count(os.sep)
    for d, dirs, files in os.walk(root):
        if "zarr.json" in files:
            try:
                with open(os.path.join(d, "zarr.json"), encoding="utf-8") as f:
                    meta = json.load(f)
            except (OSError, ValueError):
                meta = {}
            if isinstance(meta.get("attributes"), dict) and "traintape" in meta["attributes"]:
                out.append(d)
                dirs[:] = []
                continue
        if d.count(os.sep) - base >= depth:
            dirs[:] = []
        dirs.sort()
    return out


@app.command("ls")
def ls_runs(
    directory: str = typer.Argument(".", help="directory to search (3 levels deep)"),
    as_json: bool = typer.Option(False, "--json", help="machine-readable output"),
) -> None:
    """List the runs under DIR: steps, framework, size, status."""
    from traintape.core import open_run

    if not os.path.isdir(directory):
        err.print(f"[red]error:[/red] {directory} is not a directory")
        raise typer.Exit(2)
    rows = []
    for path in _find_stores(directory):
        try:
            r = open_run(path)
        except Exception as e:  # an invalid store is listed, not fatal
            rows.append({"path": path, "error": str(e)})
            continue
        st = r.steps
        rows.append(
            {
                "path": path,
                "run_id": r.manifest.run_id,
                "rows": r.rows,
                "first_step": int(st[0]) if len(st) else None,
                "last_step": int(st[-1]) if len(st) else None,
                "framework": r.manifest.producer.framework or "numpy",
                "size_bytes": _dir_size(path),
                "status": r.manifest.status,
                "updated_at": r.manifest.updated_at.isoformat(),
            }
        )
    if as_json:
        print(json.dumps(rows, indent=1))
        return
    if not rows:
        console.print(f"no traintape runs under {directory}")
        return
    t = Table("run", "steps", "framework", "size", "status", "updated")
    for x in rows:
        if "error" in x:
            t.add_row(
                os.path.relpath(x["path"], directory),
                "",
                "",
                "",
                "[red]invalid[/red]",
                x["error"][:60],
            )
            continue
        span = f"{x['rows']} ({x['first_step']}..{x['last_step']})" if x["rows"] else "0"
        color = {"closed": "green", "open": "cyan", "failed": "red"}.get(x["status"], "white")
        t.add_row(
            os.path.relpath(x["path"], directory), span, x["framework"], _human(x["size_bytes"]),
            f"[{color}]{x['status']}[/{color}]", x["updated_at"][:19],
        )  # fmt: skip
    console.print(t)


@app.command()
def health(
    run: str = typer.Argument(..., help="run directory or URL"),
    as_json: bool = typer.Option(False, "--json", help="machine-readable output"),
) -> None:
    """Gradient-flow health per layer: score, status, issues and recommendations.

    Exit code 0 unless a layer is critical (1).
    """
    from traintape.analysis import health as run_health

    r = _open(run)
    rep = run_health(r)
    if as_json:
        _json_out(rep)
        raise typer.Exit(1 if rep.status == "critical" else 0)
    color = {"healthy": "green", "warning": "yellow", "critical": "red"}
    console.print(
        f"[bold]{r.url}[/bold]: {rep.steps} steps, {len(rep.layers)} layers — "
        f"[{color[rep.status]}]{rep.status}[/{color[rep.status]}], score {rep.score:.0f}/100"
    )
    t = Table(
        "layer", "score", "status", "grad norm", "grad/param", "update/param", "zero act", "issues"
    )
    f = lambda v: "–" if v is None else f"{v:.3g}"  # noqa: E731
    for lh in rep.layers:
        c = color[lh.status]
        t.add_row(
            lh.layer, f"{lh.score:.0f}", f"[{c}]{lh.status}[/{c}]", f(lh.grad_norm), f(lh.rel_grad),
            f(lh.update_ratio), f(lh.act_zero_frac), ", ".join(i.type.value for i in lh.issues),
        )  # fmt: skip
    console.print(t)
    for i in rep.issues():
        c = color[i.severity]
        where = i.layer or "run"
        console.print(f"[{c}]{i.type.value}[/{c}] {where}: {i.message}\n    → {i.recommendation}")
    raise typer.Exit(1 if rep.status == "critical" else 0)


@app.command("anomalies")
def anomalies_cmd(
    run: str = typer.Argument(..., help="run directory or URL"),
    as_json: bool = typer.Option(False, "--json", help="machine-readable output"),
    limit: int = typer.Option(50, help="rows shown (the JSON has all)"),
) -> None:
    """NaN/Inf first seen, loss and gradient spikes, update ratios, dead units, stalls."""
    from traintape.analysis import anomalies as run_anomalies

    r = _open(run)
    rep = run_anomalies(r)
    if as_json:
        _json_out(rep)
        return
    if rep.first_nonfinite is not None:
        a = rep.first_nonfinite
        console.print(
            f"[red]first non-finite value:[/red] step {a.step}, "
            f"{a.kind.value if a.kind else 'metric'} {a.tensor}"
        )
    if not rep.anomalies:
        console.print(f"[green]no anomalies[/green] in {r.url}")
        return
    t = Table("step", "type", "severity", "kind", "tensor / layer", "message")
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


@app.command()
def report(
    run: str = typer.Argument(..., help="run directory or URL"),
    out: str = typer.Option("report.html", "--out", "-o", help="HTML file to write"),
) -> None:
    """Write one self-contained HTML report (figures embedded, no network needed)."""
    from traintape.analysis import write_report

    r = _open(run)
    with console.status("rendering report..."):
        write_report(r, out)
    console.print(f"wrote {out} ({_human(os.path.getsize(out))})")


@app.command()
def monitor(
    run: str = typer.Argument(..., help="run directory or URL being written"),
    interval: float = typer.Option(1.0, help="seconds between refreshes"),
    once: bool = typer.Option(False, "--once", help="print one view and exit"),
    max_seconds: float | None = typer.Option(None, "--max-seconds", help="stop after this long"),
) -> None:
    """Follow a run while another process writes it (committed rows only)."""
    import time

    from rich.live import Live

    r = _open(run)

    def view() -> Table:
        r.refresh()
        m = r.manifest
        st = r.steps
        t = Table(title=f"{r.url} · {m.status} · {r.rows} rows · last step "
                        f"{int(st[-1]) if len(st) else '–'} · {len(m.events)} events")  # fmt: skip
        t.add_column("layer / metric")
        t.add_column("grad norm")
        t.add_column("update/param")
        if r.rows:
            last = slice(r.rows - 1, r.rows)
            met = r.metrics()
            for c in met.columns:
                col = met[c].dropna()
                t.add_row(f"[bold]{c}[/bold]", f"{col.iloc[-1]:.6g}" if len(col) else "–", "")
            norms: dict[str, list[float]] = {}
            for kind in ("grad", "update", "param"):
                if kind not in [k.value for k in r.kinds()]:
                    continue
                data = r.stats_array(kind, rows=last)[0, :, 4]
                for n, v in zip(r.tensor_names(kind), data, strict=True):
                    layer = n.rsplit("/", 1)[0]
                    norms.setdefault(f"{kind}:{layer}", []).append(float(v) ** 2)
            layers = sorted({k.split(":", 1)[1] for k in norms})
            for layer in layers:
                g = norms.get(f"grad:{layer}")
                u, p = norms.get(f"update:{layer}"), norms.get(f"param:{layer}")
                gs = f"{sum(g) ** 0.5:.3g}" if g else "–"
                us = f"{(sum(u) / sum(p)) ** 0.5:.3g}" if u and p and sum(p) > 0 else "–"
                t.add_row(layer, gs, us)
        return t

    if once:
        console.print(view())
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
    out: str = typer.Option(..., "--out", "-o", help="directory (parquet/csv) or .npz file"),
    fmt: str = typer.Option("parquet", "--format", "-f", help="parquet, csv or npz"),
    snapshots: bool = typer.Option(False, "--snapshots", help="npz: include full snapshots"),
) -> None:
    """Export stats and metrics (and optionally snapshots) to parquet, csv or npz."""
    from traintape.analysis import export

    if fmt not in ("parquet", "csv", "npz"):
        err.print(f"[red]error:[/red] unknown format {fmt!r}: use parquet, csv or npz")
        raise typer.Exit(2)
    r = _open(run)
    with console.status(f"exporting {fmt}..."):
        paths = export(r, out, fmt, snapshots=snapshots)  # type: ignore[arg-type]
    for p in paths:
        console.print(f"wrote {p}")


@app.command()
def rm(
    run: str = typer.Argument(..., help="run directory or URL"),
    yes: bool = typer.Option(False, "--yes", "-y", help="do not ask"),
) -> None:
    """Delete a run store (only something that is a traintape store)."""
    import shutil

    from traintape.core.kvstore import KvStore, local_path

    r = _open(run)
    desc = f"{r.url} ({r.rows} rows, {r.manifest.status})"
    if not yes and not typer.confirm(f"delete run {desc}?"):
        console.print("not deleted")
        raise typer.Exit(1)
    path = local_path(r.url)
    if path is not None:
        shutil.rmtree(path)
    else:
        KvStore(r.url).delete_all()
    console.print(f"deleted {desc}")


@app.command()
def compare(
    run_a: str = typer.Argument(..., help="first run"),
    run_b: str = typer.Argument(..., help="second run (relative errors are relative to it)"),
    atol: float | None = typer.Option(None, help="absolute tolerance for every kind"),
    rtol: float | None = typer.Option(None, help="relative tolerance for every kind"),
    no_snapshots: bool = typer.Option(False, "--no-snapshots", help="compare stats only"),
    as_json: bool = typer.Option(False, "--json", help="machine-readable output"),
    show: int = typer.Option(20, help="tensors shown in the table"),
) -> None:
    """Compare two runs: structure, then values per tensor and kind within tolerance.

    Exit code 0 when identical, 1 when they differ, 2 when a store cannot be read.
    """
    from traintape.analysis import compare as run_compare

    ra, rb = _open(run_a), _open(run_b)
    with console.status("comparing..."):
        rep = run_compare(ra, rb, atol=atol, rtol=rtol, snapshots=not no_snapshots)
    if as_json:
        _json_out(rep)
        raise typer.Exit(0 if rep.identical else 1)
    c = "green" if rep.identical else "red"
    console.print(
        f"[{c}][bold]{rep.verdict}[/bold][/{c}]: {rep.a} vs {rep.b} ({rep.common_steps} common steps)"
    )
    for s in rep.structural:
        console.print(f"  [red]structure[/red] {s.message}")
    for n in rep.notes:
        console.print(f"  [dim]note: {n}[/dim]")
    if rep.first_divergence is not None:
        d = rep.first_divergence
        console.print(
            f"  first divergence: [bold]{d.kind} {d.tensor}[/bold] at step {d.first_step_out} "
            f"(via {d.first_out_via}; max abs {d.max_abs:.3g}, max rel {d.max_rel:.3g})"
        )
    bad = [t for t in rep.tensors if not t.within]
    order = {k: i for i, k in enumerate(["param", "activation", "grad", "update", "opt_state"])}
    bad.sort(key=lambda t: (t.first_step_out or 0, order.get(t.kind, 9), t.tensor))
    rows = bad[:show] if bad else sorted(rep.tensors, key=lambda t: -(t.max_abs or 0))[:show]
    t = Table(
        "kind", "tensor", "steps", "snaps", "max abs", "max rel", "min cos", "first step out", "tol"
    )
    f = lambda v: "–" if v is None else f"{v:.3g}"  # noqa: E731
    for d in rows:
        t.add_row(
            d.kind, d.tensor, str(d.steps_compared), str(d.snapshots_compared), f(d.max_abs),
            f(d.max_rel), f(d.min_cosine), "[red]" + str(d.first_step_out) + "[/red]" if not d.within else "–",
            f"{d.atol:g}/{d.rtol:g}",
        )  # fmt: skip
    if rows:
        t.title = "out of tolerance" if bad else "largest differences (all within tolerance)"
        console.print(t)
    if len(bad) > show:
        console.print(f"... {len(bad) - show} more out of tolerance (use --show or --json)")
    raise typer.Exit(0 if rep.identical else 1)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
