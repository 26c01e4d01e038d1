"""Metering (issue 15), the pure core: DCGM field table, samples and their text-format parser,
hourly rollups, GPU health classification, idle detection (M1); usage, rate cards, anomaly
rules and capacity (M2, M3). No I/O, no clock, no environment: callers pass ``now``."""
