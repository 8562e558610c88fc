"""The packages that export names lazily (``asyncrl._lazy.lazy_exports``) list each name three times:
under ``if TYPE_CHECKING:`` (for type checkers), in the submodule map ``lazy_exports`` reads, and in
``__all__``. The three lists must agree, and every listed name must resolve to its submodule's object."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LAZY_PACKAGES = ("asyncrl.algo", "asyncrl.learner", "asyncrl.models")


def _init_tree(package: str) -> ast.Module:
    path = ROOT.joinpath(*package.split("."), "__init__.py")
    return ast.parse(path.read_text(), filename=str(path))


def _type_checking_imports(tree: ast.Module) -> dict[str, str]:
    """name -> submodule it is imported from under ``if TYPE_CHECKING:``."""
    out: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for imp in node.body:
                assert isinstance(imp, ast.ImportFrom) and imp.module, ast.unparse(imp)
                out.update({a.asname or a.name: imp.module.rsplit(".", 1)[1] for a in imp.names})
    return out


def _eager_imports(tree: ast.Module) -> set[str]:
    """Names bound at import time by module-level ``from asyncrl.<package>... import`` lines."""
    return {a.asname or a.name for node in tree.body if isinstance(node, ast.ImportFrom) and node.module
            and node.module.startswith("asyncrl.") and node.module != "asyncrl._lazy" for a in node.names}


def _lazy_map(tree: ast.Module) -> dict[str, str]:
    """name -> submodule, from the dict literal handed to ``lazy_exports`` (inline or through a name)."""
    literals = {t.id: node.value for node in tree.body if isinstance(node, ast.Assign)
                for t in node.targets if isinstance(t, ast.Name)}
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "lazy_exports"]
    assert len(calls) == 1
    homes = calls[0].args[1]
    if isinstance(homes, ast.Name):
        homes = literals[homes.id]
    mapping = ast.literal_eval(homes)
    return {name: module for module, names in mapping.items() for name in names}


@pytest.mark.parametrize("package", LAZY_PACKAGES)
def test_type_checking_imports_lazy_map_and_all_list_the_same_names(package):
    tree = _init_tree(package)
    lazy = _lazy_map(tree)
    assert _type_checking_imports(tree) == lazy, "each lazy name must be imported under TYPE_CHECKING from its home"
    module = importlib.import_module(package)
    assert sorted(module.__all__) == sorted(set(module.__all__)), "a name is listed twice in __all__"
    assert set(module.__all__) == set(lazy) | _eager_imports(tree)


@pytest.mark.parametrize("package", LAZY_PACKAGES)
def test_every_lazy_name_resolves_to_the_object_of_its_submodule(package):
    module = importlib.import_module(package)
    for name, home in _lazy_map(_init_tree(package)).items():
        assert getattr(module, name) is getattr(importlib.import_module(f"{package}.{home}"), name), name
    with pytest.raises(AttributeError, match="no attribute"):
        module.__getattr__("not_exported")
