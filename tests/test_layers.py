"""The house's floors: every import in src/ goes to the same floor or one below, and no
module imports itself back through others (README "Development" shows the floors); and src/ is
pyflakes clean.

Every import counts: those inside functions, and those under ``if TYPE_CHECKING:`` (an
annotation that needs an upper floor's type is an arrow upward too).
"""

from __future__ import annotations

import ast
import io
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"

# Lowest first. A module's floor is that of its longest matching prefix.
FLOORS = [
    ("maxent_grpo.errors", "maxent_grpo.run_files", "maxent_grpo.kill_points"),
    ("maxent_grpo.core",),
    ("maxent_grpo.rollout", "maxent_grpo.tasks"),
    ("maxent_grpo.rewards",),  # the reward functions
    ("maxent_grpo.rewards.maxent",),  # the batch statistics built from rewards
    ("maxent_grpo.envs",),  # multi-turn environments and their rollout
    ("maxent_grpo.methods", "maxent_grpo.data", "maxent_grpo.models"),
    ("maxent_grpo.evaluate",),
    ("maxent_grpo.training",),  # the run
    ("maxent_grpo.config",),  # the configuration, compiled into the run's plan
    ("maxent_grpo.eval_command", "maxent_grpo.report_data", "maxent_grpo.report_html", "maxent_grpo.report",
     "maxent_grpo.cli", "maxent_grpo.front", "maxent_grpo"),
]


def floor(module: str) -> int:
    best = max(((len(p), i) for i, prefixes in enumerate(FLOORS) for p in prefixes
                if module == p or module.startswith(p + ".")), default=None)
    assert best is not None, f"{module} is on no floor: add it to FLOORS"
    return best[1]


def import_graph() -> dict[str, set[str]]:
    modules = {".".join(p.relative_to(SRC).with_suffix("").parts).removesuffix(".__init__"): p
               for p in (SRC / "maxent_grpo").rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        deps = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("maxent_grpo"):
                subs = {f"{node.module}.{a.name}" for a in node.names} & modules.keys()
                deps |= subs or {node.module}
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name.startswith("maxent_grpo")}
        # A package's __init__ runs before its modules; importing a module is not importing its package.
        graph[name] = {d for d in deps if d != name}
    return graph


def test_every_import_goes_to_the_same_floor_or_below():
    upward = [f"{m} -> {d}" for m, deps in import_graph().items() for d in deps if floor(d) > floor(m)]
    assert upward == []


def test_reward_functions_do_not_import_the_batch_statistics():
    graph = import_graph()
    functions = [m for m in graph if m.startswith("maxent_grpo.rewards.") and not m.startswith("maxent_grpo.rewards.maxent")]
    assert functions and all(not d.startswith("maxent_grpo.rewards.maxent") for m in functions for d in graph[m])


def test_no_import_cycles():
    graph = import_graph()
    state: dict[str, int] = {}
    cycles = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                cycles.append(" -> ".join(path[path.index(dep):] + [dep]))
            elif dep not in state:
                visit(dep, path + [dep])
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert cycles == []


def test_the_package_is_pyflakes_clean():
    """No unused import or variable, no undefined name, no import shadowed (pyflakes, over src/)."""
    from pyflakes.api import checkRecursive
    from pyflakes.reporter import Reporter

    out, err = io.StringIO(), io.StringIO()
    checkRecursive([str(SRC)], Reporter(out, err))
    assert out.getvalue() + err.getvalue() == ""
