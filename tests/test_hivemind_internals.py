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


#: the hivemind subclasses: what they override (and, for the runner, the state it inherits) can only
#: be used inside them
SUBCLASSES = {"SwarmAverager": "overrides only", "ExactAllReduceRunner": "all", "TrimmedMeanReducer": "all"}
#: listed internals with public-looking names that only hivemind's internals carry
DISTINCT = {"group_key_manager", "potential_leaders", "FORCE_REACHABILITY_MAPPING", "serializer", "get_stub"}


def test_hivemind_internals_are_reached_only_through_the_seam() -> None:
    """Outside greenswarm/hivemind_internals.py, a listed internal appears only inside the hivemind
    subclasses -- and in the averager, only as one of its own overrides (``def`` or ``super()``)."""
    internal = {name for name in declared() if name.startswith("_") or name in DISTINCT}
    seam = PACKAGE / "hivemind_internals.py"
    outside: list[tuple[str, str, str]] = []

    def visit(node: ast.AST, path: Path, cls: ast.ClassDef | None) -> None:
        if isinstance(node, ast.ClassDef):
            cls = node
        if isinstance(node, ast.Attribute) and node.attr in internal:
            rule = SUBCLASSES.get(cls.name) if cls is not None else None
            overrides = (
                {f.name for f in cls.body if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)}
                if cls
                else set()
            )
            if rule != "all" and not (rule == "overrides only" and node.attr in overrides):
                outside.append(
                    (path.relative_to(PACKAGE.parent).as_posix(), cls.name if cls else "", node.attr)
                )
        for child in ast.iter_child_nodes(node):
            visit(child, path, cls)

    for path in PACKAGE.rglob("*.py"):
        if path != seam:
            visit(ast.parse(path.read_text()), path, None)
    assert outside == [], outside


def test_a_renamed_internal_is_reported(monkeypatch) -> None:
    """The check itself: an internal the installed hivemind lacks is named in what it reports."""
    import greenswarm.hivemind_internals as internals

    table = dict(internals.INTERNALS)
    table["hivemind.averaging.partition:TensorPartReducer"] = ("accumulate_part", "renamed_in_a_new_release")
    monkeypatch.setattr(internals, "INTERNALS", table)
    assert internals.missing() == ["hivemind.averaging.partition:TensorPartReducer.renamed_in_a_new_release"]
