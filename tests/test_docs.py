"""The store contract (docs/store-format.md) stays true to the code.

Every kind, stat name, raw-row field, manifest field (of every manifest model and the
capture policy), array path of ``traintape/core/layout.py`` and the current schema
version must appear in the document; the package and the repository's Markdown must
not cite the outside design brief the contract replaced.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from traintape.core import layout as L
from traintape.schema import (
    RAW_NAMES,
    SCHEMA_VERSION,
    STAT_NAMES,
    CapturePolicy,
    CommitMark,
    Event,
    Kind,
    Manifest,
    Producer,
    StoreLayout,
    TensorSpec,
    WriterStats,
)

REPO = Path(__file__).resolve().parents[1]
STORE_FORMAT = REPO / "docs" / "store-format.md"
ARCHITECTURE = REPO / "docs" / "architecture.md"


@pytest.fixture(scope="module")
def doc() -> str:
    return STORE_FORMAT.read_text(encoding="utf-8")


def _missing_code_spans(text: str, names: list[str]) -> list[str]:
    """Names that do not appear as a Markdown code span (`name`) in ``text``."""
    return [n for n in names if f"`{n}`" not in text]


def test_every_kind_is_documented(doc):
    assert _missing_code_spans(doc, [k.value for k in Kind]) == []


def test_every_stat_is_documented_in_store_order(doc):
    assert _missing_code_spans(doc, list(STAT_NAMES)) == []
    # the table of the stat vector lists them in store order, numbered
    rows = re.findall(r"^\| (\d+) \| `([a-z_0-9]+)` \|", doc, flags=re.M)
    assert [(int(i), n) for i, n in rows] == list(enumerate(STAT_NAMES))


def test_every_raw_field_is_documented_in_order(doc):
    assert _missing_code_spans(doc, list(RAW_NAMES)) == []
    section = doc.split("### Raw rows", 1)[1].split("\n## ", 1)[0]
    fields = re.findall(r"^\| `([a-z_0-9]+)` \|", section, flags=re.M)
    assert fields == list(RAW_NAMES)


@pytest.mark.parametrize(
    "model",
    [Manifest, Producer, StoreLayout, TensorSpec, Event, CommitMark, WriterStats, CapturePolicy],
    ids=lambda m: m.__name__,
)
def test_every_manifest_field_is_documented(doc, model):
    assert f"### `{model.__name__}`" in doc, f"no section for {model.__name__}"
    assert _missing_code_spans(doc, list(model.model_fields)) == []


def _layout_patterns() -> list[str]:
    """The array path patterns drawn in layout.py's module docstring (``RUN/...``)."""
    assert L.__doc__ is not None
    return re.findall(r"RUN/(\S+)\s", L.__doc__)


def test_layout_docstring_draws_every_path_builder():
    """The patterns checked below are the paths the writer actually builds."""
    patterns = _layout_patterns()
    regexes = [re.compile("^" + re.sub(r"<[a-z]+>", r"[A-Za-z0-9_/-]+", p) + "$") for p in patterns]
    built = [
        L.STEPS,
        L.stats_path(Kind.GRAD),
        L.metric_path("train/loss"),
        L.snapshot_path(Kind.PARAM, "encoder/0/kernel"),
        L.snapshot_steps_path(Kind.ACTIVATION),
    ]
    for path in built:
        assert any(r.match(path) for r in regexes), f"{path} matches no pattern of {patterns}"
    assert {p.split("/")[0] for p in patterns} >= {
        L.STEPS, L.STATS, L.METRICS, L.SNAPSHOTS, L.SNAPSHOT_STEPS, "zarr.json"
    }  # fmt: skip


def test_every_layout_path_is_documented(doc):
    patterns = _layout_patterns()
    assert patterns, "layout.py's docstring draws no tree"
    missing = [p for p in patterns if f"RUN/{p}" not in doc]
    assert missing == []


def test_schema_version_is_documented(doc):
    assert f"**{SCHEMA_VERSION}**" in doc
    assert "READABLE_MAJORS" in doc


def test_architecture_names_files_that_exist():
    """Every ``traintape/...`` or ``core/...``-style file path the docs name exists."""
    missing = []
    for path in (STORE_FORMAT, ARCHITECTURE):
        text = path.read_text(encoding="utf-8")
        for ref in sorted(set(re.findall(r"`((?:traintape|conformance)/[\w/{},.-]+\.\w+)", text))):
            m = re.match(r"(.*)\{([\w,]+)\}(.*)", ref)
            refs = [m[1] + part + m[3] for part in m[2].split(",")] if m else [ref]
            missing += [r for r in refs if not (REPO / r).exists()]
        for ref in sorted(set(re.findall(r"`((?:core|schema|analysis|adapters)/[\w/.]+\.(?:py|c|json))", text))):  # fmt: skip
            if not (REPO / "traintape" / ref).exists():
                missing.append(ref)
    assert missing == []


def _files_that_must_not_cite_the_brief() -> list[Path]:
    files = [
        p for p in (REPO / "traintape").rglob("*") if p.is_file() and "__pycache__" not in p.parts
    ]
    for p in REPO.iterdir():
        if p.name.startswith(".") or p.name in ("node_modules",) or p.name.endswith(".egg-info"):
            continue
        if p.is_file() and p.suffix == ".md":
            files.append(p)
        elif p.is_dir():
            files += [
                q
                for q in p.rglob("*.md")
                if not any(s.startswith(".") for s in q.relative_to(REPO).parts)
            ]
    return files


_BRIEF = re.compile(r"\bDESIGN\b")


def test_nothing_cites_the_outside_design_brief():
    hits = []
    for p in _files_that_must_not_cite_the_brief():
        try:
            text = p.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # binary files (compiled kernels, images)
        for i, line in enumerate(text.splitlines(), 1):
            if _BRIEF.search(line):
                hits.append(f"{p.relative_to(REPO)}:{i}: {line.strip()[:100]}")
    assert hits == [], "\n".join(hits)


def test_readme_links_the_docs():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert "docs/store-format.md" in readme
    assert "docs/architecture.md" in readme


_CITATION = re.compile(r'docs/store-format\.md[`\s,(]{0,6}"([^"\n]+)"')


def test_sections_cited_by_the_code_exist():
    """A section of the store contract cited by name (the file name, then the section
    in double quotes) in code or Markdown is a real heading of the document."""
    headings = set(re.findall(r"^#+ (.+?)\s*$", STORE_FORMAT.read_text(encoding="utf-8"), re.M))
    cited: dict[str, str] = {}
    for root in ("traintape", "conformance", "tests", "docs", "benchmarks", "examples"):
        for p in (REPO / root).rglob("*"):
            if p.suffix not in (".py", ".md", ".json") or "__pycache__" in p.parts:
                continue
            for section in _CITATION.findall(p.read_text(encoding="utf-8", errors="replace")):
                cited.setdefault(section, str(p.relative_to(REPO)))
    assert cited, "no citation found: the pattern is stale"
    missing = {s: where for s, where in cited.items() if s not in headings}
    assert missing == {}


def test_architecture_file_tables_name_files_that_exist():
    """Bare file names (`rows.py`) in a section headed by a package directory
    (`traintape/core/`) are files of that directory; elsewhere, files of the package (or
    of the repository root, as `setup.py`)."""
    text = ARCHITECTURE.read_text(encoding="utf-8")
    package_files = {p.name for p in (REPO / "traintape").rglob("*") if p.is_file()}
    missing = []
    for section in re.split(r"^### ", text, flags=re.M)[1:]:
        heading = section.splitlines()[0]
        home = re.search(r"`(traintape/[\w/]+/)`", heading)
        for name in sorted(set(re.findall(r"`(\w+\.(?:py|c|json))`", section))):
            if name == "zarr.json":
                continue  # a store file, not a source file
            ok = (REPO / home[1] / name).is_file() if home else name in package_files
            ok = ok or (REPO / name).is_file()  # a file at the repository root (setup.py)
            if not ok:
                missing.append(f"{heading}: {name}")
    assert missing == []


# ---------------------------------------------------------------- the documentation site


def _build_site(tmp_path: Path, extra_pages: dict[str, str] | None = None) -> Path:
    """``mkdocs build --strict`` of a copy of docs/ and mkdocs.yml (plus ``extra_pages``),
    into ``tmp_path/site``; fails with mkdocs's output when the build does."""
    import shutil
    import subprocess
    import sys

    root = tmp_path / "repo"
    root.mkdir()
    shutil.copytree(REPO / "docs", root / "docs")
    shutil.copy(REPO / "mkdocs.yml", root / "mkdocs.yml")
    (root / "traintape").symlink_to(REPO / "traintape")  # mkdocstrings reads the sources
    for rel, text in (extra_pages or {}).items():
        (root / "docs" / rel).write_text(text, encoding="utf-8")
    site = tmp_path / "site"
    r = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(site)],
        cwd=root, capture_output=True, text=True, timeout=600,
        env={**os.environ, "PYTHONPATH": str(REPO), "NO_MKDOCS_2_WARNING": "1"},
    )  # fmt: skip
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    return site


def test_mkdocs_build_strict_takes_in_new_pages_and_generates_the_references(tmp_path):
    """The site builds with ``--strict`` (a broken link, a missing API object or a bad
    docstring reference fails it); a page another change adds to docs/ appears in the
    navigation without being listed; the CLI reference lists every command; the API
    pages are rendered from the docstrings."""
    from traintape.cli import app

    new = {"a-new-page.md": "# A page nobody listed\n\nText.\n",
           "tutorials/another-framework.md": "# Another framework\n\nText.\n"}  # fmt: skip
    site = _build_site(tmp_path, new)
    home = (site / "index.html").read_text(encoding="utf-8")
    for page in ("a-new-page/", "tutorials/another-framework/", "tutorials/jax/",
                 "tutorials/compare-frameworks/", "cli/", "api/", "store-format/",
                 "architecture/", "sparse-update/"):  # fmt: skip
        assert f'href="{page}"' in home, f"{page} is not in the navigation"
    cli_page = (site / "cli" / "index.html").read_text(encoding="utf-8")
    names = [c.name or c.callback.__name__ for c in app.registered_commands]
    assert names and all(f"traintape {n}" in cli_page for n in names)
    assert "--json" in cli_page
    api = (site / "api" / "traintape" / "index.html").read_text(encoding="utf-8")
    assert "Recorder" in api and "resume_step" in api  # from the docstrings/signatures


def test_every_readme_link_exists():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", readme)
    assert links
    missing = [ln for ln in links if "://" not in ln and not (REPO / ln).exists()]
    assert missing == []


def test_compare_two_frameworks_tutorial_runs_end_to_end(tmp_path):
    """docs/tutorials/compare-frameworks.md: its script runs as written and the two runs it
    records (PyTorch and JAX/Flax) compare identical, as the page shows."""
    import subprocess
    import sys

    pytest.importorskip("torch")
    pytest.importorskip("flax")
    page = (REPO / "docs" / "tutorials" / "compare-frameworks.md").read_text(encoding="utf-8")
    script = re.search(r"```python\n(.*?)```", page, flags=re.S)[1]
    env = {"PATH": os.environ.get("PATH", ""), "HOME": str(tmp_path), "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    from traintape.analysis import compare

    res = compare(str(tmp_path / "runs/cmp/torch"), str(tmp_path / "runs/cmp/jax"))
    assert res.identical
    out = subprocess.run(
        [sys.executable, "-m", "traintape.cli", "compare", "runs/cmp/torch", "runs/cmp/jax"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0 and out.stdout.startswith("identical"), out.stdout[-2000:]
    # piped, the table keeps every column (no terminal: not cut to 80 columns)
    header = next(line for line in out.stdout.splitlines() if "first out" in line)
    assert "worst/tol" in header and "min cos" in header and "noise floor" in header
