"""The serving benchmark: seeded workloads, an async load generator, in-process baselines, reports."""
