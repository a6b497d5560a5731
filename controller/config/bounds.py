"""Upper bounds of the numeric settings: far above any sane value, low enough that no value
can stall the sidecar for ever (1e308 s is "never"). Every settings module takes them here."""

DAY_S = 86_400.0
HOUR_S = 3_600.0
MiB = 1 << 20
MAX_BYTES = 1 << 50  # 1 PiB: a memory budget or footprint, far above any device
