"""The layering rules, checked on the source and in fresh interpreters.

schema ← core ← adapters / analysis ← cli: ``traintape.schema`` imports nothing else
from traintape; ``traintape.core`` imports no ML framework and not the package root;
``traintape.analysis`` imports no ML framework; an adapter imports no other adapter
(except the Keras adapter's JAX-backend module, which uses the JAX adapter's transport);
and ``import traintape`` (and core, schema, analysis) loads no ML framework.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "traintape"
FRAMEWORKS = ("jax", "jaxlib", "flax", "optax", "equinox", "torch", "tensorflow", "keras")
ADAPTERS = ("jax", "torch", "tf")
BACKEND_OF = {"traintape.adapters.tf.keras_jax": "jax"}
"""The Keras adapter's module for Keras on the JAX backend records through the JAX
adapter's transport (stats inside the jitted step, ordered host callbacks): Keras on JAX
*is* JAX, and the transport is written once."""


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _imports(path: Path) -> list[tuple[str, int]]:
    """Absolute module names imported by ``path`` (relative imports resolved)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    pkg = _module_name(path).split(".")
    if path.name != "__init__.py":
        pkg = pkg[:-1]
    out: list[tuple[str, int]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg[: len(pkg) - node.level + 1]
                mod = ".".join([*base, node.module] if node.module else base)
            else:
                mod = node.module or ""
            out.append((mod, node.lineno))
            if mod == "traintape":  # `from traintape import x` imports traintape.x too
                out += [(f"traintape.{a.name}", node.lineno) for a in node.names]
    return out


MODULES = sorted(ROOT.rglob("*.py"))


def _top(mod: str) -> str:
    return mod.split(".")[0]


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT.parent)))
def test_layer_rules(path: Path) -> None:
    name = _module_name(path)
    bad: list[str] = []
    for mod, line in _imports(path):
        where = f"{path.relative_to(ROOT.parent)}:{line} imports {mod}"
        if (
            name.startswith("traintape.schema")
            and _top(mod) == "traintape"
            and not mod.startswith("traintape.schema")
        ):
            bad.append(f"{where} (schema imports nothing else from traintape)")
        if name.startswith("traintape.core"):
            if _top(mod) in FRAMEWORKS:
                bad.append(f"{where} (core imports no ML framework)")
            if mod == "traintape" or (
                _top(mod) == "traintape"
                and not mod.startswith(("traintape.core", "traintape.schema", "traintape._"))
            ):
                bad.append(f"{where} (core imports only schema, core and private root modules)")
        if name.startswith("traintape.analysis"):
            if _top(mod) in FRAMEWORKS:
                bad.append(f"{where} (analysis imports no ML framework)")
            if mod.startswith(
                ("traintape.adapters", "traintape.jax", "traintape.torch", "traintape.tf")
            ):
                bad.append(f"{where} (analysis imports no adapter)")
        if name.startswith("traintape.adapters."):
            own = name.split(".")[2]
            for other in ADAPTERS:
                if other == BACKEND_OF.get(name):
                    continue
                if other != own and mod.startswith(f"traintape.adapters.{other}"):
                    bad.append(f"{where} (an adapter imports no other adapter)")
    assert not bad, "\n".join(bad)


def test_no_framework_loaded_by_framework_free_packages() -> None:
    """In a fresh interpreter, importing these loads no ML framework."""
    code = (
        "import json, sys\n"
        "import traintape, traintape.schema, traintape.core, traintape.analysis\n"
        "import traintape.cli\n"
        f"print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in {FRAMEWORKS!r})))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_every_module_imports_in_a_fresh_interpreter() -> None:
    """No import cycle or import-time failure: each module imports on its own."""
    names = [_module_name(p) for p in MODULES if not p.name.startswith("__main__")]
    code = (
        "import importlib, json, sys, traceback\n"
        f"names = {names!r}\n"
        "bad = {}\n"
        "for n in names:\n"
        "    for m in [k for k in sys.modules if k == 'traintape' or k.startswith('traintape.')]:\n"
        "        del sys.modules[m]\n"
        "    try:\n"
        "        importlib.import_module(n)\n"
        "    except ImportError as e:\n"
        "        if getattr(e, 'name', None) and e.name.split('.')[0] != 'traintape':\n"
        "            continue  # an optional dependency is not installed\n"
        "        bad[n] = traceback.format_exc(limit=3)\n"
        "    except Exception:\n"
        "        bad[n] = traceback.format_exc(limit=3)\n"
        "print(json.dumps(bad))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=600
    )
    bad = json.loads(out.stdout.strip().splitlines()[-1])
    assert not bad, "\n\n".join(f"{k}:\n{v}" for k, v in bad.items())
