"""Policy files: schema, loading with field-naming errors, and JSON Schema export."""

from fallbackgate.policy.loader import PolicyError, hardware_profile, load_policy, loads_policy, parse_policy
from fallbackgate.policy.schema import (
    CONTROLLER_KINDS,
    FALLBACK_TAGS,
    SLO,
    AuditSpec,
    ControllerSpec,
    HardwareSpec,
    MemorySpec,
    Policy,
    QualityBudget,
    RequestClass,
    json_schema,
)

__all__ = [
    "CONTROLLER_KINDS",
    "FALLBACK_TAGS",
    "SLO",
    "AuditSpec",
    "ControllerSpec",
    "HardwareSpec",
    "MemorySpec",
    "Policy",
    "PolicyError",
    "QualityBudget",
    "RequestClass",
    "hardware_profile",
    "json_schema",
    "load_policy",
    "loads_policy",
    "parse_policy",
]
