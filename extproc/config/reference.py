"""The configuration reference (docs/configuration.md), generated from the schema.

    python -m extproc.config.reference > docs/configuration.md

One section per settings type, reached from `Config` in field order: the type's docstring, then a
table of its fields with their type, default, constraints, and whether a running server keeps
the field's value until it restarts (RESTART_ONLY). A test keeps the committed page equal to this
output.
"""

from __future__ import annotations

import enum
import inspect
import sys
import types
import typing
from collections.abc import Iterator

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from extproc.config.schema import Config, restart_only_fields

HEADER = """# Configuration reference

Generated from the schema (`extproc/config/schema.py`) by `python -m extproc.config.reference`;
do not edit by hand. How the routing config is used, checked and reloaded: [operations](operations.md).
Durations are in seconds unless a name says otherwise (`_ms`: milliseconds). **restart** marks a
field that a running server keeps until it restarts; every other field takes effect on reload.
"""


def render() -> str:
    """The whole page, Markdown."""
    sections = [HEADER]
    for path, model in _models(Config, "", set()):
        sections.append(_section(path, model))
    return "\n".join(sections)


def _models(model: type[BaseModel], path: str, seen: set[type]) -> Iterator[tuple[str, type[BaseModel]]]:
    """(dotted path, model) for `model` and every settings type under it, depth first."""
    if model in seen:
        return
    seen.add(model)
    yield path or "(top level)", model
    for name, field in model.model_fields.items():
        for nested in _nested_models(field.annotation):
            suffix = "[]" if _is_list(field.annotation) else ".<model>" if _is_dict(field.annotation) else ""
            yield from _models(nested, f"{path}.{name}{suffix}".lstrip("."), seen)


def _nested_models(annotation) -> list[type[BaseModel]]:
    if inspect.isclass(annotation) and issubclass(annotation, BaseModel):
        return [annotation]
    found = []
    for arg in typing.get_args(annotation):
        found += _nested_models(arg)
    return found


def _is_list(annotation) -> bool:
    return typing.get_origin(annotation) is list


def _is_dict(annotation) -> bool:
    return typing.get_origin(annotation) is dict


def _section(path: str, model: type[BaseModel]) -> str:
    doc = inspect.cleandoc(model.__doc__ or "")
    restart = set(restart_only_fields(model))
    rows = ["| field | type | default | constraints | |", "|---|---|---|---|---|"]
    for name, field in model.model_fields.items():
        rows.append(
            f"| `{name}` | {_type(field.annotation)} | {_default(field)} | {_constraints(field)} | {'restart' if name in restart else ''} |"
        )
    return f"## `{path}`\n\n{model.__name__}. {doc}\n\n" + "\n".join(rows) + "\n"


def _type(annotation) -> str:
    return _type_text(annotation).replace("|", "\\|")


def _type_text(annotation) -> str:
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Annotated:
        return _type_text(args[0])
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_text(a) for a in args)
    if origin is typing.Literal:
        return " / ".join(f"`{a}`" for a in args)
    if origin in (list, frozenset, set, tuple):
        return f"list of {_type_text(args[0])}"
    if origin is dict:
        return f"map of {_type_text(args[0])} to {_type_text(args[1])}"
    if annotation is type(None):
        return "null"
    if inspect.isclass(annotation) and issubclass(annotation, enum.Enum):
        return " / ".join(f"`{member.value}`" for member in annotation)
    return getattr(annotation, "__name__", str(annotation))


def _default(field: FieldInfo) -> str:
    if field.is_required():
        return "required"
    value = field.default if field.default is not PydanticUndefined else field.default_factory()
    if isinstance(value, BaseModel):
        return "(its defaults)"
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, (list, tuple, frozenset, set)):
        value = [item.value if isinstance(item, enum.Enum) else item for item in value]
        return ", ".join(f"`{item}`" for item in value) if value else "empty"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    return f"`{value}`"


def _constraints(field: FieldInfo) -> str:
    parts = []
    for meta in field.metadata:
        for attr, sign in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"), ("min_length", ""), ("pattern", "matches")):
            value = getattr(meta, attr, None)
            if value is not None:
                parts.append(f"length >= {value}" if attr == "min_length" else f"{sign} `{value}`")
    return "; ".join(parts).replace("|", "\\|")


if __name__ == "__main__":
    sys.stdout.write(render())
