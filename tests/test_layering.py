"""The package's layering (docs/design.md, "Layers"): what each part may import.

Walks every module of ``kvbridge`` with ``ast`` (imports under ``TYPE_CHECKING``
and inside functions count too) and checks each ``kvbridge.*`` import against
:data:`ALLOWED`. The connector side (what a vLLM user runs) never imports the
reference host; the proxy imports nothing of the connector (it starts without
torch); inside the reference host, ``paged`` < ``engine`` < the server. A new
package must be placed in the table before its first import passes.
"""

from __future__ import annotations

import ast
from pathlib import Path

import kvbridge

_CONNECTOR_SIDE = frozenset({"errors", "topology", "kernels", "transfer", "connector"})

#: Part -> the parts it may import (its own modules always). A part is the
#: longest key that prefixes a module's dotted name under ``kvbridge``; ``""``
#: is ``kvbridge/__init__.py``.
ALLOWED: dict[str, frozenset[str]] = {
    "": frozenset(),
    "errors": frozenset(),
    "http_common": frozenset(),
    "topology": frozenset({"errors"}),
    "kernels": frozenset({"errors", "topology"}),
    "transfer": frozenset({"errors", "topology", "kernels"}),
    "connector": frozenset({"errors", "topology", "kernels", "transfer"}),
    "integrations": _CONNECTOR_SIDE,
    "proxy": frozenset({"errors", "http_common"}),
    "reference.paged": frozenset({"errors"}),
    "reference.engine": _CONNECTOR_SIDE | {"reference.paged"},
    "reference": _CONNECTOR_SIDE | {"http_common", "reference.paged", "reference.engine"},
    "cli": _CONNECTOR_SIDE | {"http_common", "proxy", "reference", "reference.paged",
                              "reference.engine", "integrations", "cli.bench"},
    # The benchmarks may import every part; of the rest only ``kvbridge bench``
    # (cli/bench.py) imports them.
    "cli.bench": frozenset({"cli", "bench"}),
    "bench": _CONNECTOR_SIDE | {"http_common", "proxy", "reference", "reference.paged",
                                "reference.engine", "integrations", "cli"},
}


def part_of(module: str) -> str:
    """The :data:`ALLOWED` key of a dotted module name (``kvbridge.x.y`` or ``x.y``)."""
    name = module.removeprefix("kvbridge").removeprefix(".")
    best = ""
    for key in ALLOWED:
        if key and (name == key or name.startswith(key + ".")) and len(key) > len(best):
            best = key
    if name and not best:
        raise KeyError(f"kvbridge.{name} belongs to no part of the layering table: add it")
    return best


def _imports(tree: ast.AST, module: str, is_package: bool) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")
                anchor = anchor[: len(anchor) - node.level + (1 if is_package else 0)]
                base = ".".join([*anchor, base] if base else anchor)
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)
    return {n for n in found if n == "kvbridge" or n.startswith("kvbridge.")}


def violations(root: Path) -> list[str]:
    """Every import under ``root`` (the ``kvbridge`` directory) that the table forbids."""
    bad = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root.parent).with_suffix("")
        is_package = rel.name == "__init__"
        module = ".".join(rel.parts[:-1] if is_package else rel.parts)
        here = part_of(module)
        for target in sorted(_imports(ast.parse(path.read_text()), module, is_package)):
            try:
                there = part_of(target)
            except KeyError:
                # ``from kvbridge.x import name``: the name is not a module.
                there = part_of(target.rsplit(".", 1)[0])
            if there and there != here and there not in ALLOWED[here]:
                bad.append(f"{module} ({here or 'kvbridge'}) imports {target} ({there})")
    return bad


def test_kvbridge_keeps_its_layers() -> None:
    root = Path(kvbridge.__file__).parent
    assert violations(root) == []


def test_an_upward_import_is_reported(tmp_path: Path) -> None:
    pkg = tmp_path / "kvbridge"
    (pkg / "transfer").mkdir(parents=True)
    (pkg / "reference" / "paged").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "transfer" / "__init__.py").write_text("")
    (pkg / "reference" / "__init__.py").write_text("")
    (pkg / "reference" / "paged" / "__init__.py").write_text("")
    (pkg / "reference" / "paged" / "host_memory.py").write_text("")
    (pkg / "transfer" / "local_kv.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from kvbridge.reference.paged.host_memory import shared_region\n"
        "from ..reference.paged import host_memory\n")
    assert violations(pkg) == [
        "kvbridge.transfer.local_kv (transfer) imports kvbridge.reference.paged (reference.paged)",
        "kvbridge.transfer.local_kv (transfer) imports kvbridge.reference.paged.host_memory "
        "(reference.paged)",
        "kvbridge.transfer.local_kv (transfer) imports "
        "kvbridge.reference.paged.host_memory.shared_region (reference.paged)",
    ]


def test_the_table_names_what_exists() -> None:
    root = Path(kvbridge.__file__).parent
    for key in filter(None, ALLOWED):
        path = root.joinpath(*key.split("."))
        assert path.is_dir() or path.with_suffix(".py").is_file(), key
