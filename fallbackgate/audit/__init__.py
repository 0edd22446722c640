"""The audit: diff statistics against the exact baseline, the auditor that computes them, and the gate."""
