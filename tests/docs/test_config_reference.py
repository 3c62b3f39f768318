"""docs/configuration.md is the schema's own description (extproc.config.reference): it changes
with the schema, never apart from it."""

from __future__ import annotations

from extproc.config import restart_only_fields
from extproc.config.reference import render
from extproc.config.schema import RedisSettings, ServerSettings
from tests.support.configs import ROOT


def test_the_committed_reference_is_the_generated_one():
    committed = (ROOT / "docs" / "configuration.md").read_text()
    assert committed == render(), "regenerate it: python -m extproc.config.reference > docs/configuration.md"


def test_every_restart_only_field_is_marked():
    page = render()
    for model in (ServerSettings, RedisSettings):
        for name in restart_only_fields(model):
            assert any(line.startswith(f"| `{name}` |") and line.rstrip().endswith("| restart |") for line in page.splitlines()), name
    assert "listen" in restart_only_fields(ServerSettings) and "max_body_bytes" not in restart_only_fields(ServerSettings)
