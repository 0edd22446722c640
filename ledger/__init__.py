"""Ledger: SQL record of every engine step, fallback tag and diff against the exact baseline."""
