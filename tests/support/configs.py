"""Configs and paths the tests share."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
"""The repository's root."""


def small_config_data(redis_url: str = "redis://127.0.0.1:6379/0", **overrides) -> dict:
    """Two managed providers with small limits for model m, one unlimited third party."""
    limits = {
        "max_pinned_sessions": 2,
        "max_global_in_flight_request_slots": 4,
        "global_in_flight_request_slots_reserved_for_pinned_sessions": 1,
        "max_per_session_in_flight_request_slots": 2,
    }
    data = {
        "providers": [
            {"name": "iris-1", "kind": "managed", "cluster": "iris-1",
             "models": {"m": {"features": ["chat", "completions", "tools"], "limits": limits},
                        "e": {"features": ["embeddings"], "limits": limits}}},
            {"name": "iris-2", "kind": "managed", "cluster": "iris-2",
             "models": {"m": {"features": ["chat", "completions"], "limits": limits}}},
            {"name": "tensorx", "kind": "unlimited", "cluster": "tensorx",
             "models": {"m": {"features": ["chat", "completions", "tools"]},
                        "e": {"features": ["embeddings"]}}},
        ],
        "redis": {"url": redis_url, "key_prefix": "t"},
    }
    data.update(overrides)
    return data
