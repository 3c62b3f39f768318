"""Files the package ships beside its code: the Lua scripts and the Envoy and routing examples.

In a wheel they are package data (`extproc/lua/`, `extproc/envoy/`, see pyproject.toml); in a
source checkout or an editable install they are the repository's `lua/` and `envoy/` folders.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

_REPOSITORY = Path(__file__).resolve().parent.parent


def _folder(name: str) -> Path:
    packaged = Path(str(resources.files("extproc").joinpath(name)))
    if packaged.is_dir():
        return packaged
    return _REPOSITORY / name


def lua_folder() -> Path:
    """The folder of the Lua scripts (`lib.lua` and one file per script)."""
    return _folder("lua")


def envoy_yaml() -> Path:
    """The shipped Envoy bootstrap (`envoy/envoy.yaml`)."""
    return _folder("envoy") / "envoy.yaml"


def example_config() -> Path:
    """The shipped example routing configuration (`envoy/example-config.yaml`), which names the
    clusters of `envoy_yaml()`."""
    return _folder("envoy") / "example-config.yaml"
