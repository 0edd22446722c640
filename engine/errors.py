"""Errors the engine raises with messages meant for users."""


class EngineError(Exception):
    """Base class of the engine's user-facing errors."""


class CheckpointError(EngineError):
    """The model directory is missing, incomplete, or holds an unsupported model."""


class BudgetError(EngineError):
    """A memory budget is too small for the engine to make progress."""


class ChecksumError(EngineError):
    """A spilled page failed its checksum; its bytes must not be used."""


class PromptError(EngineError):
    """A prompt is empty, too long, or otherwise unusable."""
