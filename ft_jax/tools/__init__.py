"""Tools that depend on the offload layer only (never on api/cli): routing traces (trace_io), their replay through the
cache plan (replay), reports (report) and the plan recommendation (plan)."""
