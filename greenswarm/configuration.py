"""Load component configs (dataclasses) from YAML files and ``--set key=value`` overrides.

Each component owns a dataclass (the scheduler's, the averager's, the node's...). This module turns
YAML into those dataclasses with strict checking, because a typo in a site config should stop a site
at start-up with a line that names the file, the line and the field, not hours later with a traceback.
Type checks follow the dataclass annotations (a ``Literal[...]`` field takes exactly one of its
values: "must be one of a, b, got 'c'"); a dataclass may add ``validate()`` for value checks and
raise :class:`~greenswarm.errors.ConfigError` with the field's own name.
"""

from __future__ import annotations

import dataclasses
import datetime
import difflib
import math
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml

from greenswarm.errors import ConfigError

T = TypeVar("T")

#: dotted field path -> 1-based line number in the YAML file, used to locate errors
LineMap = dict[str, int]


def _line_map(node: yaml.Node, prefix: str = "") -> LineMap:
    """Walk a composed YAML tree and remember on which line each dotted key was written."""
    lines: LineMap = {}
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            key = f"{prefix}.{key_node.value}" if prefix else str(key_node.value)
            lines[key] = key_node.start_mark.line + 1
            lines.update(_line_map(value_node, key))
    return lines


def read_yaml(path: str | Path) -> tuple[dict[str, Any], LineMap]:
    """Read a YAML mapping and its line map; errors name the file (and line for syntax errors)."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError("config file not found", where=str(path)) from None
    except OSError as e:
        raise ConfigError(f"cannot read config file: {e.strerror}", where=str(path)) from None
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        raise ConfigError(f"invalid YAML: {e.problem}", where=where) from None
    except yaml.YAMLError as e:
        raise ConfigError(f"invalid YAML: {e}", where=str(path)) from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError("the top level must be a mapping of fields", where=f"{path}:1")
    return data, (_line_map(node) if node is not None else {})


def _describe(value: Any) -> str:
    return f"{type(value).__name__} {value!r}"


def _convert(value: Any, annotation: Any, field: str) -> Any:
    """Check and convert one value against a (resolved) type annotation; raise ConfigError on mismatch."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if annotation is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors: list[ConfigError] = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(value, arg, field)
            except ConfigError as e:
                errors.append(e)
        if len(errors) == 1:  # an optional section: its own error, naming the field inside it
            raise errors[0]
        raise ConfigError(" or ".join(e.message for e in errors), field=field)
    if origin is typing.Literal:
        if value in args:
            return value
        raise ConfigError(f"must be one of {', '.join(map(str, args))}, got {value!r}", field=field)
    if dataclasses.is_dataclass(annotation):
        if not isinstance(value, dict):
            raise ConfigError(f"expected a mapping of fields, got {_describe(value)}", field=field)
        return _build(annotation, value, field)
    if origin in (list, tuple) or annotation in (list, tuple):
        if isinstance(value, str):  # a single item where a list is expected: accept it, users write that
            value = [value]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"expected a list, got {_describe(value)}", field=field)
        item_type = args[0] if args else Any
        return [_convert(v, item_type, f"{field}[{i}]") for i, v in enumerate(value)]
    if origin is dict or annotation is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"expected a mapping, got {_describe(value)}", field=field)
        return dict(value)
    if annotation is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"expected true or false, got {_describe(value)}", field=field)
    if annotation is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"expected an integer, got {_describe(value)}", field=field)
    if annotation is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "3e-4" as a string; accept numeric strings
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"expected a number, got {_describe(value)}", field=field)
    if annotation is str:
        if isinstance(value, str):
            return value
        if isinstance(value, datetime.date):  # YAML reads an unquoted ISO time as a datetime
            return value.isoformat().replace("+00:00", "Z")
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"expected a string, got {_describe(value)}", field=field)
    return value


def _build(cls: type[T], data: dict[str, Any], prefix: str = "") -> T:
    """Build dataclass ``cls`` from a mapping, recursively; unknown and missing fields are errors."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    kwargs = {}
    for key, value in data.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else f"; known fields: {', '.join(fields)}"
            raise ConfigError(f"unknown field{hint}", field=path)
        kwargs[key] = _convert(value, hints[key], path)
    for name, f in fields.items():
        if (
            name not in kwargs
            and f.default is dataclasses.MISSING
            and f.default_factory is dataclasses.MISSING
        ):
            raise ConfigError("missing required field", field=f"{prefix}.{name}" if prefix else name)
    obj = cls(**kwargs)
    validate = getattr(obj, "validate", None)
    if callable(validate):
        try:
            validate()
        except ConfigError as e:
            raise e.located(prefix or None) from None
    return obj


def _locate(err: ConfigError, source: str, lines: LineMap) -> ConfigError:
    """Attach ``file:line`` of the culprit field (or its nearest written parent) to an error."""
    field = err.field or ""
    probe = field.split("[")[0]
    while probe and probe not in lines:
        probe = probe.rpartition(".")[0]
    where = f"{source}:{lines[probe]}" if probe in lines else source
    return ConfigError(err.message, field=err.field, where=where)


def parse_override(text: str) -> tuple[str, Any]:
    """Parse one ``key.path=value`` override; the value is read as YAML (so numbers and lists work)."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"expected key=value, got {text!r}", where="--set")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key, value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Return a copy of ``data`` with dotted ``key=value`` overrides applied."""
    import copy

    data = copy.deepcopy(data)
    for text in overrides:
        key, value = parse_override(text)
        node = data
        parts = key.split(".")
        for part in parts[:-1]:
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ConfigError(f"'{part}' is not a section, cannot set '{key}'", where="--set")
            node = child
        node[parts[-1]] = value
    return data


def load_config(
    cls: type[T],
    path: str | Path | None = None,
    overrides: list[str] | None = None,
    base: dict[str, Any] | None = None,
) -> T:
    """Load dataclass ``cls`` from an optional YAML file plus ``--set`` overrides.

    Errors in the file name ``file:line``; errors in an override name ``--set key=value``.
    """
    data: dict[str, Any] = dict(base or {})
    lines: LineMap = {}
    source = "<defaults>"
    if path is not None:
        file_data, lines = read_yaml(path)
        data.update(file_data)
        source = str(path)
    overrides = list(overrides or [])
    merged = apply_overrides(data, overrides)
    try:
        return _build(cls, merged)
    except ConfigError as e:
        field = (e.field or "").split("[")[0]
        for text in reversed(overrides):  # the last override of a field is the one that counts
            key = text.partition("=")[0].strip()
            if field and (field == key or field.startswith(key + ".") or key.startswith(field + ".")):
                raise ConfigError(e.message, field=e.field, where=f"--set {text}") from None
        if overrides and _valid(cls, data):  # the file alone is fine: a cross-field check an override broke
            raise ConfigError(e.message, field=e.field, where="--set " + " --set ".join(overrides)) from None
        raise _locate(e, source, lines) from None


def _valid(cls: type, data: dict[str, Any]) -> bool:
    try:
        _build(cls, data)
    except ConfigError:
        return False
    return True


def config_from_dict(cls: type[T], data: dict[str, Any], source: str = "<dict>") -> T:
    """Build ``cls`` from a plain mapping (for configs made in code, e.g. by the demo)."""
    try:
        return _build(cls, data)
    except ConfigError as e:
        raise ConfigError(e.message, field=e.field, where=source) from None


def to_dict(cfg: Any) -> dict[str, Any]:
    """A dataclass config as plain data (for YAML dumps and progress records)."""
    return dataclasses.asdict(cfg)


def dump_yaml(cfg: Any) -> str:
    """A dataclass config as YAML that :func:`load_config` reads back to an equal config."""
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def check_number(value: object, name: str, *, minimum: float, inclusive: bool) -> None:
    """Check that ``value`` is a finite real number above ``minimum`` (bools are not numbers here)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ConfigError(f"must be a number, got {value!r}", field=name)
    if value < minimum or (not inclusive and value == minimum):
        raise ConfigError(f"must be {'>=' if inclusive else '>'} {minimum:g}, got {value!r}", field=name)


def validate_section(value: object, cls: type, name: str) -> None:
    """Validate a nested config section (a dataclass with ``validate``) set in code or loaded, naming
    ``name`` as the parent of whatever field inside it is wrong."""
    if not isinstance(value, cls):
        raise ConfigError(f"must be a mapping of {name} settings", field=name)
    try:
        value.validate()
    except ConfigError as err:
        raise err.located(name) from None
