"""Configuration: the routing config's schema (restart-only settings marked), loading it from
YAML with every problem named, the check of a routing config against an Envoy file, and the
shipped examples.

The names most code needs are re-exported here: `from extproc.config import Config, load_config`.
"""

from extproc.config.loading import ConfigError, load_config, parse_config
from extproc.config.schema import (
    DEFAULT_PRIVATE_HEADERS,
    FEATURE_CLASSES,
    LOAD_PRESETS,
    RESTART_ONLY,
    ROUTER_SESSION_HEADERS,
    SUB_FEATURES,
    AdmissionQueue,
    Affinity,
    Config,
    Credentials,
    HealthCheck,
    IdentitySource,
    LoadGauge,
    LoadSignal,
    ModelLimits,
    PriorityClass,
    Provider,
    ProviderKind,
    RedisSettings,
    SessionSignal,
    restart_only_fields,
)

__all__ = [
    "ROUTER_SESSION_HEADERS", "AdmissionQueue", "Affinity", "DEFAULT_PRIVATE_HEADERS", "FEATURE_CLASSES",
    "RESTART_ONLY", "SUB_FEATURES", "Config", "ConfigError", "Credentials", "HealthCheck", "IdentitySource",
    "LOAD_PRESETS", "LoadGauge", "LoadSignal", "ModelLimits", "PriorityClass", "Provider", "ProviderKind",
    "RedisSettings", "SessionSignal", "load_config", "parse_config", "restart_only_fields",
]
