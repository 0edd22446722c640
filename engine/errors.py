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


class ExpertReadError(ChecksumError):
    """An expert's bytes read from the checkpoint do not match the manifest's xxh3-64 (`found` is the digest
    of what was read; None when the read itself failed)."""

    def __init__(self, message: str, expected: str, found: str | None) -> None:
        super().__init__(message)
        self.expected, self.found = expected, found
