"""This machine's measured hardware profile: measurement, fit and the per-machine cache."""

from fallbackgate.profiling.store import MEASURED, PROFILE_NAMES, measured_profile, resolve_profile

__all__ = ["MEASURED", "PROFILE_NAMES", "measured_profile", "resolve_profile"]
