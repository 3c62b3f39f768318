"""The example files the package ships: the Envoy bootstrap and the routing config that names
its clusters.

In a wheel they are package data (`extproc/envoy/`, see pyproject.toml); in a source checkout or
an editable install they are the repository's `envoy/` folder.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

_REPOSITORY = Path(__file__).resolve().parents[2]


def _envoy_folder() -> Path:
    packaged = Path(str(resources.files("extproc").joinpath("envoy")))
    if packaged.is_dir():
        return packaged
    return _REPOSITORY / "envoy"


def envoy_yaml() -> Path:
    """The shipped Envoy bootstrap (`envoy/envoy.yaml`)."""
    return _envoy_folder() / "envoy.yaml"


def example_config() -> Path:
    """The shipped example routing configuration (`envoy/example-config.yaml`), which names the
    clusters of `envoy_yaml()`."""
    return _envoy_folder() / "example-config.yaml"
