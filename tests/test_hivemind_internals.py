"""The hivemind internals greenswarm relies on: all of them listed, all of them in the pinned hivemind."""

from __future__ import annotations

import ast
from pathlib import Path

from greenswarm.hivemind_internals import declared, missing

PACKAGE = Path(__file__).resolve().parents[1] / "greenswarm"


def test_the_installed_hivemind_has_every_internal_greenswarm_uses() -> None:
    """A hivemind that renamed one of them would break a swarm mid-round; this says which, at once."""
    assert missing() == [], "hivemind no longer has: " + ", ".join(missing())


def test_every_private_name_greenswarm_touches_is_its_own_or_listed() -> None:
    """A ``._name`` that greenswarm neither defines nor lists in greenswarm/hivemind_internals.py is an
    undeclared hivemind internal (or a typo): list it there, or stop using it."""
    trees = {path: ast.parse(path.read_text()) for path in PACKAGE.rglob("*.py")}
    ours: set[str] = set()
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                ours.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                ours.add(node.attr)
            elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) in (
                "setattr",
                "__setattr__",
            ):  # object.__setattr__(self, "_name", ...) in a frozen dataclass
                ours.update(a.value for a in node.args[1:2] if isinstance(a, ast.Constant))
            elif isinstance(node, ast.AnnAssign | ast.Assign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                ours.update(t.id for t in targets if isinstance(t, ast.Name))
    used = {
        (path.relative_to(PACKAGE.parent).as_posix(), node.attr)
        for path, tree in trees.items()
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
    }
    public = {"_exit"}  # os._exit: documented, not private
    undeclared = sorted((p, name) for p, name in used if name not in ours | public | declared())
    assert undeclared == [], undeclared


def test_a_renamed_internal_is_reported(monkeypatch) -> None:
    """The check itself: an internal the installed hivemind lacks is named in what it reports."""
    import greenswarm.hivemind_internals as internals

    table = dict(internals.INTERNALS)
    table["hivemind.averaging.partition:TensorPartReducer"] = ("accumulate_part", "renamed_in_a_new_release")
    monkeypatch.setattr(internals, "INTERNALS", table)
    assert internals.missing() == ["hivemind.averaging.partition:TensorPartReducer.renamed_in_a_new_release"]
