"""Load generation: seeded workloads, driving them through a router, and the figures a run
reports."""
