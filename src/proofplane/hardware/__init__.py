"""Hardware facts: SKU tables, MIG geometry, simulated clusters (and, later, the NVML collector)."""
