"""Imports point one way (costmodels <- search_spaces <- autotune <- cli) and autotune's modules form
no cycle, counting imports inside functions too (issue 9); nothing below the CLI imports the `api` facade."""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LAYERS = ("costmodels", "search_spaces", "autotune", "cli")


def _imports(path: Path, package: str) -> set[str]:
    """Modules of ours that `path` imports anywhere in its body, as 'package.module'."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package if node.level == 1 else ""
                names = [f"{base}.{node.module}"] if node.module else [f"{base}.{a.name}" for a in node.names]
            else:
                names = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
            out.update(n for n in names if n.split(".")[0] in LAYERS)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.split(".")[0] in LAYERS)
    return out


def _graph() -> dict[str, set[str]]:
    mods = {f"{p.parent.name}.{p.stem}": p for layer in LAYERS for p in (REPO / layer).glob("*.py")}
    return {m: {i for i in _imports(p, m.split(".")[0]) if i in mods and i != m} for m, p in mods.items()}


def test_layers_import_only_downward():
    for mod, deps in _graph().items():
        for dep in deps:
            assert LAYERS.index(dep.split(".")[0]) <= LAYERS.index(mod.split(".")[0]), (mod, dep)


#: the search, study, storage and report modules (issue 9 named cycles among them); the calibration
#: modules have cycles of their own (validate <-> measurements <-> calibrate, validate <-> datasets)
#: that are not checked here
CHECKED = ("api", "optuna_search", "objectives", "samplers", "study_spec", "ask_tell", "storage", "trials",
           "studies", "report", "sensitivity", "search", "scoring", "problem")


def test_search_modules_are_on_no_import_cycle_and_nothing_imports_the_api_from_below():
    graph = _graph()
    assert not [m for m, deps in graph.items() if "autotune.api" in deps and not m.startswith("cli.")]
    for name in CHECKED:
        start = f"autotune.{name}"
        seen, todo = set(), [(d, [start, d]) for d in graph[start]]
        while todo:
            m, path = todo.pop()
            assert m != start, " -> ".join(path)
            if m not in seen:
                seen.add(m)
                todo += [(d, path + [d]) for d in graph[m]]
