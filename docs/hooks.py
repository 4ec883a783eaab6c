"""MkDocs hooks of the documentation site (issue 68): the pages built from the repository's
own sources, so that the site and the README never disagree.

- ``index.md`` is README.md. Its links to repository files outside the site (recipes,
  benchmarks, tests) become the files' paths in code, since the site has no copy of them.
- ``recipes.md`` lists every recipe under ``recipes/`` with its header comment.
- ``api/*.md`` hold one ``:::`` block per public name (``lightning_fl.__all__``,
  ``lightning_fl.callbacks.__all__``, ``lightning_fl.datamodules.__all__``) and per module
  of ``lightning_fl.systems`` and ``lightning_fl.engine``, rendered by mkdocstrings.
- A public name without a docstring of its own is a warning, so ``mkdocs build --strict``
  fails on it, as it does on a broken link or cross-reference.
"""

from __future__ import annotations

import builtins
import importlib
import inspect
import json
import logging
import pkgutil
import re
import shutil
from functools import partial
from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[1]
log = logging.getLogger("mkdocs.hooks.lightning_fl")

#: the packages whose public names are documented one by one, and their page
PACKAGES = {
    "lightning_fl": "api/lightning_fl.md",
    "lightning_fl.callbacks": "api/callbacks.md",
    "lightning_fl.datamodules": "api/datamodules.md",
}
#: the packages documented module by module
MODULE_PAGES = {
    "lightning_fl.systems": ("api/systems.md", "Systems: the papers' mathematics"),
    "lightning_fl.engine": ("api/engine.md", "Engine: how a round happens"),
    "lightning_fl.flower": ("api/flower.md", "Flower: sites across institutions"),
}
LINK = re.compile(r"\]\((?!https?://|#|mailto:)([^)\s]+)\)")


def readme_page() -> str:
    """README.md with its links to repository files written as the files' paths."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")

    def local(match: re.Match) -> str:
        target = match.group(1)
        path = target.split("#", 1)[0]
        if path in ("", "README.md"):
            return f"]({target.removeprefix('README.md')})"
        return f"]({_repository(path)})"

    return LINK.sub(local, text)


def _repository(path: str) -> str:
    """The site's page for a repository file: the recipes page for a recipe, the API
    reference for a module, else the architecture page's list of repository files."""
    if path.startswith("recipes/") and path.endswith(".yaml"):
        return "recipes.md#" + _anchor(path.removeprefix("recipes/"))
    return "architecture.md#repository-files"


def _anchor(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def recipes_page() -> str:
    lines = [
        "# Recipes",
        "",
        "Every recipe runs with `lightning-fl fit --config <path>` from a clone; its header "
        "comment says what it reproduces. The README's recipe table groups them by topic.",
        "",
    ]
    for path in sorted((ROOT / "recipes").rglob("*.yaml")):
        name = path.relative_to(ROOT / "recipes").as_posix()
        header = []
        for line in path.read_text(encoding="utf-8").splitlines():
            if not line.startswith("#"):
                break
            header.append(line.lstrip("#").strip())
        lines += [f"## {name} {{#{_anchor(name)}}}", "", " ".join(header) or "(no header)", ""]
        lines += ["```bash", f"lightning-fl fit --config recipes/{name}", "```", ""]
    return "\n".join(lines)


def public_names(package: str) -> list[tuple[str, object]]:
    module = importlib.import_module(package)
    return [(name, getattr(module, name)) for name in sorted(module.__all__)]


def own_docstring(obj: object) -> str | None:
    """The docstring written for ``obj`` itself (not one inherited from a base class)."""
    if inspect.isclass(obj):
        return obj.__dict__.get("__doc__")
    return getattr(obj, "__doc__", None)


def names_page(package: str) -> str:
    """One ``:::`` block per public name of ``package``; a package with ``FAMILIES``
    (family -> its modules, as ``lightning_fl.callbacks`` lists them) in one section per
    family, the names of no family's module (the contract, the figures) first."""
    lines = [f"# `{package}`", ""]
    families: dict[str, tuple[str, ...]] = getattr(importlib.import_module(package),
                                                   "FAMILIES", {})  # fmt: skip
    first = "The contract, FedAvg and the figures" if families else ""
    sections: dict[str, list[str]] = {first: [], **{family: [] for family in families}}
    for name, obj in public_names(package):
        if not (own_docstring(obj) or "").strip():
            log.warning(f"{package}.{name} has no docstring: write one (docs/hooks.py checks).")
        module = getattr(obj, "__module__", package)
        family = next((f for f, modules in families.items()
                       if module.rsplit(".", 1)[-1] in modules), first)  # fmt: skip
        sections[family] += [f"::: {module}.{name}", ""]
    for family, blocks in sections.items():
        if family and blocks:
            lines += [f"## {family}", ""]
        lines += blocks
    return "\n".join(lines)


def rendered_elsewhere() -> dict[str, list[str]]:
    """The public names of :data:`PACKAGES`, by the module that defines them: the module
    pages leave them out (each object is rendered once, where users import it)."""
    names: dict[str, list[str]] = {}
    for package in PACKAGES:
        for name, obj in public_names(package):
            names.setdefault(getattr(obj, "__module__", package), []).append(name)
    return names


def modules_page(package: str, title: str) -> str:
    lines = [f"# {title}", ""]
    module = importlib.import_module(package)
    elsewhere = rendered_elsewhere()
    for info in sorted(pkgutil.iter_modules(module.__path__), key=lambda i: i.name):
        if info.name.startswith("_") or info.ispkg:
            continue
        path = f"{package}.{info.name}"
        filters = ["!^_", *(f"!^{name}$" for name in elsewhere.get(path, []))]
        lines += [f"::: {path}", "    options:", "      heading_level: 2",
                  f"      filters: {json.dumps(filters)}", ""]  # fmt: skip
    return "\n".join(lines)


def api_index() -> str:
    return "\n".join([
        "# API reference",
        "",
        "Generated from the docstrings. Public names are those the packages export:",
        "",
        "- [Core](lightning_fl.md): the strategy, samplers, availability, models "
        "(`from lightning_fl import ...`);",
        "- [Callbacks](callbacks.md): the plugins (`lightning_fl.callbacks`);",
        "- [Data modules](datamodules.md): federations and their splits "
        "(`lightning_fl.datamodules`);",
        "- [Systems](systems.md): the papers' mathematics, free of Lightning;",
        "- [Engine](engine.md): how a round happens (for plugin authors).",
        "- [Flower](flower.md): sites on Flower's runtime (`lightning-fl[flower]`).",
        "",
    ])  # fmt: skip


ROLE = re.compile(r":(class|mod|func|meth|attr|data|exc|obj):`(~?)([^`]+)`")


def source_tree() -> Path:
    """``build/docs_src/lightning_fl``: a copy of the package's Python files in its
    installed layout (``callbacks/`` and ``datamodules/`` inside ``lightning_fl``, as
    pyproject's package-dir maps them), for mkdocstrings to read statically. The Sphinx
    roles of the docstrings (``:class:`~lightning_fl.FedAvg```) become links to where the
    site renders the object (plain code where it renders none), and each target must
    import: a role naming nothing is a broken cross-reference (a warning)."""
    tree = ROOT / "build" / "docs_src"
    shutil.rmtree(tree, ignore_errors=True)
    sources = {"lightning_fl": ROOT / "lightning_fl", "lightning_fl/callbacks": ROOT /
               "callbacks", "lightning_fl/datamodules": ROOT / "datamodules"}  # fmt: skip
    for destination, source in sources.items():
        for path in source.rglob("*.py"):
            relative = Path(destination) / path.relative_to(source)
            target = tree / relative
            target.parent.mkdir(parents=True, exist_ok=True)
            module = ".".join(relative.with_suffix("").parts).removesuffix(".__init__")
            text = fenced_examples(path.read_text(encoding="utf-8"))
            roles = partial(_role, module=module, path=path)
            target.write_text(ROLE.sub(roles, text), encoding="utf-8")
    return tree


def fenced_examples(text: str) -> str:
    """Each run of doctest lines (``>>>``, ``...`` and their output, up to a blank line
    or the docstring's end) inside a fence, so that the site shows it as code."""
    lines, out, inside = text.splitlines(), [], None
    for line in lines:
        stripped = line.strip()
        if inside is None and stripped.startswith(">>>"):
            inside = line[: len(line) - len(line.lstrip())]
            out.append(f"{inside}```python")
        elif inside is not None and (not stripped or stripped.startswith('"""')):
            out.append(f"{inside}```")
            inside = None
        out.append(line)
    return "\n".join(out) + "\n"


def _role(match: re.Match, module: str, path: Path) -> str:
    kind, short, target = match.groups()
    instance_attribute = kind == "attr" and re.search(
        rf"self\.{re.escape(target.rsplit('.', 1)[-1])}\b", path.read_text(encoding="utf-8")
    )
    if not (instance_attribute or resolves(target, module)):
        where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
        log.warning(f"{where}: {match.group(0)} names nothing importable: "
                    "fix the cross-reference.")  # fmt: skip
    shown = target.rsplit(".", 1)[-1] if short else target.lstrip(".")
    identifier = canonical(target, module)
    if identifier is None:
        return f"`{shown}`"
    # a link where the object is rendered (autorefs; optional: plain code where it is not)
    return f'<autoref identifier="{identifier}" optional><code>{shown}</code></autoref>'


def canonical(target: str, module: str) -> str | None:
    """The dotted path under which the site renders the object a role names (its
    defining module and qualified name), or None when it names no class, function,
    module or attribute of one (a relative target is read as :func:`resolves` reads it)."""
    for candidate in _candidates(target, module):
        found = _object_path(candidate)
        if found is not None:
            return found
    return None


def _candidates(target: str, module: str) -> list[str]:
    """The dotted names a role's target may mean: absolute, then relative to ``module``
    and to each of its packages, innermost first (a leading dot read as relative)."""
    name = target.lstrip(".")
    parts = module.split(".")
    return [name] + [f"{'.'.join(parts[:i])}.{name}" for i in range(len(parts), 0, -1)]


def _longest_module(dotted: str) -> tuple[object, list[str]] | None:
    """The longest importable module prefix of ``dotted`` and the names after it."""
    parts = dotted.split(".")
    for split in range(len(parts), 0, -1):
        try:
            return importlib.import_module(".".join(parts[:split])), parts[split:]
        except ImportError:
            continue
    return None


def _object_path(dotted: str) -> str | None:
    """``dotted``'s canonical path: its longest importable module, then the attributes,
    re-rooted at each class or function's own ``__module__.__qualname__``."""
    found = _longest_module(dotted)
    if found is None:
        return None
    obj, rest = found
    path = obj.__name__
    for part in rest:
        if not hasattr(obj, part):
            return None
        obj = getattr(obj, part)
        owner = getattr(obj, "__module__", None)
        qualname = getattr(obj, "__qualname__", None)
        if (inspect.isclass(obj) or inspect.isfunction(obj)) and owner and qualname:
            path = f"{owner}.{qualname}"
        else:
            path = f"{path}.{part}"
    return path


def resolves(target: str, module: str) -> bool:
    """Whether a role's target names an object: absolute, relative to ``module`` or one
    of its packages (a leading dot), or a name of ``module`` or of one of its classes."""
    name = target.lstrip(".")
    if any(_imports(candidate) for candidate in _candidates(target, module)):
        return True
    try:
        namespace = importlib.import_module(module)
    except ImportError:
        return False
    first = name.split(".")[0]
    classes = [c for c in vars(namespace).values() if inspect.isclass(c)]
    return any(_attribute(c, name) for c in classes) or hasattr(builtins, first)


def _imports(dotted: str) -> bool:
    found = _longest_module(dotted)
    return found is not None and (not found[1] or _attribute(found[0], ".".join(found[1])))


def _attribute(obj: object, dotted: str) -> bool:
    for part in dotted.split("."):
        if not part:
            continue
        annotations = getattr(obj, "__annotations__", {}) if inspect.isclass(obj) else {}
        if part in annotations and not hasattr(obj, part):
            return True  # a dataclass field or an annotated attribute
        if not hasattr(obj, part):
            return False
        obj = getattr(obj, part)
    return True


def on_files(files, config):
    pages = {
        "index.md": readme_page(),
        "recipes.md": recipes_page(),
        "api/index.md": api_index(),
        **{page: names_page(package) for package, page in PACKAGES.items()},
        **{page: modules_page(pkg, title) for pkg, (page, title) in MODULE_PAGES.items()},
    }
    for path, content in pages.items():
        existing = files.get_file_from_path(path)
        if existing is not None:
            files.remove(existing)
        files.append(File.generated(config, path, content=content))
    return files


# The tree must exist before mkdocstrings reads its ``paths`` (at its own set-up, before
# any hook event runs): written when MkDocs loads these hooks.
source_tree()
