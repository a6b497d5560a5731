"""One model: its record, its manager and runner, the steps, reconciliation, its footprint."""
