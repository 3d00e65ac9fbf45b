"""The orchestration core stays pure Python: the simulator must run it without any runtime."""

from __future__ import annotations

import subprocess
import sys


def test_orchestrator_and_kv_manager_import_no_runtime():
    code = (
        "import sys\n"
        "import kvflow.kv_manager, kvflow.orchestrator.engine, kvflow.orchestrator.llm\n"
        "import kvflow.orchestrator.async_engine, kvflow.orchestrator.scheduler.core\n"
        "import kvflow.sim.simulator, kvflow.sim.cost_model, kvflow.workloads.flags\n"
        "import kvflow.workloads.prompts, kvflow.reports.summary\n"
        "heavy = [m for m in ('torch', 'onnxruntime', 'tensorrt', 'triton_python_backend_utils',"
        " 'transformers') if m in sys.modules]\n"
        "print(','.join(heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"imported: {out.stdout.strip()}"


def _kvflow_imports() -> dict[str, set[str]]:
    """Every kvflow module -> the kvflow modules it imports, at the top or inside a function
    (imports under ``if TYPE_CHECKING:`` are for the type checker only and are left out)."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "kvflow"
    modules = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = (path, parts[-1] == "__init__")
    graph: dict[str, set[str]] = {}
    for name, (path, is_pkg) in modules.items():
        tree = ast.parse(path.read_text())
        skip: set[int] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
        edges: set[str] = set()
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.Import):
                edges.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    pkg = name.split(".") if is_pkg else name.split(".")[:-1]
                    pkg = pkg[: len(pkg) - node.level + 1]
                    base = ".".join(pkg + ([node.module] if node.module else []))
                for a in node.names:
                    sub = f"{base}.{a.name}"
                    edges.add(sub if sub in modules else base)
        graph[name] = {e for e in edges if e in modules and e != name}
    return graph


def test_no_import_cycles():
    """No two kvflow modules import each other, directly or around a loop, even through an
    import inside a function: each layer stands on the ones below it."""
    graph = _kvflow_imports()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


def test_the_module_map_names_every_module():
    """docs/design.md's module map stays true to the tree: it names every kvflow module, and
    no module that is gone."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    design = (root / "docs" / "design.md").read_text()
    rows = [line for line in design[design.index("## Modules"):].splitlines()
            if line.startswith("| `")]
    named = {path for row in rows for path in re.findall(r"`([\w/]+\.(?:py|c))`",
                                                          row.split(" | ")[0])}
    modules = {str(p.relative_to(root / "kvflow")) for p in (root / "kvflow").rglob("*.py")
               if p.name != "__init__.py" or p.stat().st_size > 200}
    modules |= {str(p.relative_to(root / "kvflow")) for p in (root / "kvflow").rglob("*.c")}
    assert sorted(modules - named) == [], "modules missing from docs/design.md's module map"
    assert sorted(named - modules) == [], "docs/design.md names modules that do not exist"
