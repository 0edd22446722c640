"""Serving prompts through an engine: prompt files, sessions, recording to the ledger, what a run prints."""
