"""The package's shape: no import circles, between modules or between rooms (each top-level module and each
subpackage), small modules, a short top level. Read from the source (ast), so a circle hidden inside a
function's import is found too."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "polytrain"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict:
    """module -> the polytrain modules it imports anywhere in its text (top level or inside functions)."""
    modules = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = (
                    ".".join(
                        package[: len(package) - node.level + 1] + [node.module]
                        if node.module
                        else package[: len(package) - node.level + 1]
                    )
                    if node.level
                    else node.module
                )
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    targets.add(full if full in modules else base)
            elif isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
        graph[name] = {target for target in targets if target in modules and target != name}
    return graph


def circles(graph: dict) -> list:
    """The strongly connected groups of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in graph:
        if node not in index:
            visit(node)
    return found


def test_the_circle_finder_finds_a_circle_through_three_modules():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_the_graph_reads_relative_imports_and_imports_inside_functions():
    graph = import_graph()
    assert "polytrain.commands" in graph["polytrain.cli"]  # imported inside run_command
    assert "polytrain.config.train" in graph["polytrain.config"]  # `from .train import ...` in __init__
    assert "polytrain.errors" in graph["polytrain.runtime.launch"]  # `from ..errors import ...`


def test_no_module_imports_one_that_imports_it_back():
    assert circles(import_graph()) == []


def room_of(module: str) -> str:
    """The room a module is in: its subpackage (`polytrain.runtime.worker` -> `runtime`), or itself for a
    top-level module (`polytrain.api` -> `api`)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def room_graph(graph: dict) -> dict:
    """room -> {a room it imports: the modules whose imports make that edge}, from a module graph."""
    rooms = {}
    for module, targets in graph.items():
        edges = rooms.setdefault(room_of(module), {})
        for target in targets:
            if room_of(target) != room_of(module):
                edges.setdefault(room_of(target), set()).add(module)
    return rooms


def room_circles(rooms: dict) -> list:
    """Each circle of rooms, as its edges: `config -> cli (polytrain.config.reference)`."""
    found = circles({room: {target for target in edges if target in rooms} for room, edges in rooms.items()})
    return [
        [
            f"{room} -> {target} ({', '.join(sorted(rooms[room][target]))})"
            for room in group
            for target in sorted(rooms[room])
            if target in group
        ]
        for group in found
    ]


def test_the_room_finder_names_the_imports_that_close_a_circle():
    graph = {
        "polytrain.low.a": {"polytrain.high"},
        "polytrain.low.b": set(),
        "polytrain.high": {"polytrain.low.b", "polytrain.errors"},
        "polytrain.errors": set(),
    }
    assert room_circles(room_graph(graph)) == [
        ["high -> low (polytrain.high)", "low -> high (polytrain.low.a)"]
    ]
    del graph["polytrain.low.a"]
    assert room_circles(room_graph(graph)) == []


def test_the_rooms_import_downward_only():
    # the layers, lowest first, are in docs/architecture.md ("The layers"): an import that runs back up, even
    # inside a function, makes a circle of rooms
    found = room_circles(room_graph(import_graph()))
    assert found == [], "rooms that import each other in a circle:\n" + "\n".join(
        "\n".join(edges) for edges in found
    )


def test_no_module_is_over_500_formatted_lines():
    # counted after `ruff format` (test_style.py keeps it formatted): one idea per module, not short lines
    long = {
        module_name(path): n
        for path in PACKAGE.rglob("*.py")
        if (n := len(path.read_text().splitlines())) > 500
    }
    assert long == {}


def test_the_top_level_holds_at_most_14_modules():
    top = sorted(
        path.name for path in PACKAGE.glob("*.py") if path.name not in ("__init__.py", "__main__.py")
    )
    assert len(top) <= 14, top
