"""The code-shape targets of issue 68, measured: ``python benchmarks/code_shape.py``.

Prints the counts the issue sets targets for: reads of ``trainer.strategy`` in
``callbacks/`` and the attributes they read, hand-written ``state_dict`` pairs there, the
length of ``FederatedStrategy`` and of the longest functions in ``lightning_fl/``, of
``Unlearning``, ``engine/vectorized.py`` and the datamodules' ``__init__``, and the doctests;
and those of issue 79: capability flags assigned by hand in ``callbacks/`` and plugin class
names quoted in ``engine/composition.py``.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _sources(folder: str) -> list[Path]:
    return sorted((ROOT / folder).rglob("*.py"))


def _length(node: ast.AST) -> int:
    return node.end_lineno - node.lineno + 1


def _strategy_reads() -> tuple[int, set[str]]:
    reads, names = 0, set()
    for path in _sources("callbacks"):
        text = path.read_text()
        reads += text.count("trainer.strategy")
        names |= set(re.findall(r"strategy\.([A-Za-z_]\w*)", text))
    return reads, names


def _state_dict_pairs(folder: str) -> list[str]:
    pairs = []
    for path in _sources(folder):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                methods = {n.name for n in node.body if isinstance(n, ast.FunctionDef)}
                if {"state_dict", "load_state_dict"} <= methods:
                    pairs.append(f"{path.relative_to(ROOT)}:{node.name}")
    return pairs


def _functions(folder: str) -> list[tuple[int, str]]:
    found = []
    for path in _sources(folder):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                found.append((_length(node), f"{path.relative_to(ROOT)}:{node.name}"))
    return sorted(found, reverse=True)


def _class_length(path: str, name: str) -> int:
    tree = ast.parse((ROOT / path).read_text())
    return next(
        _length(n) for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == name
    )


def _init_lengths(folder: str) -> list[tuple[int, str]]:
    return [(n, name) for n, name in _functions(folder) if name.endswith(":__init__")]


#: The flags issue 79 derives from declarations: assigning one by hand is what it forbids.
DERIVED_FLAGS = ("keeps_client_state", "client_state_in_store")


def _flags_set_by_hand(folder: str) -> list[str]:
    """``path:line`` of every assignment to a derived flag (class attribute or ``self.``)."""
    found = []
    for path in _sources(folder):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Assign | ast.AnnAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    name = getattr(target, "id", None) or getattr(target, "attr", None)
                    if name in DERIVED_FLAGS:
                        found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def _class_names_in_rules() -> list[str]:
    """The package's plugin class names quoted as strings in engine/composition.py."""
    classes = {
        node.name
        for folder in ("callbacks", "datamodules", "lightning_fl/systems")
        for path in _sources(folder)
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ClassDef) and not node.name.startswith("_")
    }
    tree = ast.parse((ROOT / "lightning_fl/engine/composition.py").read_text())
    return sorted(
        {
            node.value
            for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str)
            and node.value in classes
        }
    )  # fmt: skip


def main() -> None:
    reads, names = _strategy_reads()
    print(f"trainer.strategy reads in callbacks/: {reads}, attributes: {sorted(names)}")
    pairs = _state_dict_pairs("callbacks")
    print(f"hand-written state_dict pairs in callbacks/: {len(pairs)} {pairs}")
    strategy = ROOT / "lightning_fl/engine/strategy.py"
    print(
        f"engine/strategy.py: {len(strategy.read_text().splitlines())} lines; class "
        f"FederatedStrategy {_class_length('lightning_fl/engine/strategy.py', 'FederatedStrategy')}"
    )
    longest = [f for f in _functions("lightning_fl") if f[0] > 50]
    print(f"functions over 50 lines in lightning_fl/: {len(longest)} {longest[:5]}")
    print(f"Unlearning: {_class_length('callbacks/unlearning.py', 'Unlearning')} lines")
    vectorized = ROOT / "lightning_fl/engine/vectorized.py"
    print(f"engine/vectorized.py: {len(vectorized.read_text().splitlines())} lines")
    print(f"longest datamodule __init__: {_init_lengths('datamodules')[:1]}")
    outside = [
        str(p.relative_to(ROOT))
        for folder in ("lightning_fl", "callbacks", "datamodules", "recipes", "docs")
        for p in (ROOT / folder).rglob("*")
        if p.suffix in (".py", ".md", ".yaml")
        and re.search(r"DESIGN\.md|\.\./shared", p.read_text())
    ]
    readme = re.findall(r"DESIGN\.md|\.\./shared", (ROOT / "README.md").read_text())
    print(f"references to files outside the repository: {len(outside) + len(readme)} {outside}")
    doctests = sum(
        p.read_text().count(">>> ") for p in _sources("lightning_fl") + _sources("callbacks")
    )
    print(f"doctest lines (>>>): {doctests}")
    flags = _flags_set_by_hand("callbacks")
    print(f"capability flags set by hand in callbacks/: {len(flags)} {flags}")
    names = _class_names_in_rules()
    print(f"plugin class names in engine/composition.py's rules: {len(names)} {names}")


if __name__ == "__main__":
    main()
