"""YAML text that may hold anything, read without an exception escaping but one.

PyYAML's safe loader raises more than `yaml.YAMLError`: a plain scalar that looks like a date
but is none (`2020-02-30`: ValueError), a hex number without digits (`0x_`), an explicit tag
whose value does not fit it (`!!float x`, `!!bool maybe`: KeyError), and nesting deeper than
Python's recursion limit (RecursionError). `parse_yaml` turns each into YamlTextError, so that
the routing config, the Envoy file and a reload of either name the problem in one line instead
of dying with a traceback.
"""

from __future__ import annotations

from typing import Any

import yaml

# What PyYAML's safe constructors raise besides YAMLError (see the module docstring).
_CONSTRUCTOR_ERRORS = (ValueError, LookupError, TypeError, ArithmeticError, RecursionError)


class YamlTextError(ValueError):
    """Text that is not YAML the safe loader can read; the message is one line, without the
    file's name (the caller adds it)."""


def parse_yaml(text: str) -> Any:
    """The value of the YAML document `text` (None for an empty one). Raises YamlTextError."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise YamlTextError(_one_line(exc)) from None
    except _CONSTRUCTOR_ERRORS as exc:
        raise YamlTextError(f"a value that cannot be read ({type(exc).__name__}: {_one_line(exc)})") from None


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:300]
