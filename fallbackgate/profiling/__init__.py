"""This machine's measured hardware profile: measurement, fit and the per-machine cache."""

from fallbackgate.profiling.names import MEASURED, PROFILE_NAMES
from fallbackgate.profiling.store import measured_profile, resolve_profile

__all__ = ["MEASURED", "PROFILE_NAMES", "measured_profile", "resolve_profile"]
