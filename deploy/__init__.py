"""pdkv deploy."""
