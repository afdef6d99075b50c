"""Running pdkv on a cluster: readiness probes for orchestrators (``pdkv probe``) and
placement on Ray (docs/cluster.md)."""
