"""The hardware profile names a policy or the command line may use, in one place.

``measured`` is this machine's cached measurement (:mod:`fallbackgate.profiling.store`); the others are
the shipped what-ifs (:data:`fallbackgate.engine.hardware.PROFILES`).
"""

from __future__ import annotations

from fallbackgate.engine.hardware import PROFILES

MEASURED = "measured"
PROFILE_NAMES: tuple[str, ...] = (MEASURED, *PROFILES)
"""Every profile name: ``measured``, then the shipped what-ifs."""
