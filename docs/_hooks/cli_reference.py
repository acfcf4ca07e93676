"""MkDocs hook: the CLI reference (docs/cli.md) generated from the typer app itself.

The marker ``<!-- traintape-cli -->`` in a page is replaced by typer's own Markdown
rendering of ``traintape.cli.app`` (what ``typer traintape.cli utils docs`` prints: every
command's help, usage, arguments and options, as ``traintape COMMAND --help`` shows
them), so the reference cannot drift from the code.
"""

from __future__ import annotations

from typing import Any

MARKER = "<!-- traintape-cli -->"


def render() -> str:
    """The reference as Markdown, its headings one level below the page's title."""
    import typer
    from typer.cli import get_docs_for_click

    from traintape.cli import app

    root = typer.main.get_command(app)
    ctx = typer.Context(root, info_name="traintape")
    text = get_docs_for_click(obj=root, ctx=ctx, name="traintape", title="Commands")
    return "\n".join("#" + line if line.startswith("#") else line for line in text.splitlines())


def on_page_markdown(markdown: str, page: Any, **kwargs: Any) -> str:
    if MARKER in markdown:
        return markdown.replace(MARKER, render())
    return markdown
