"""pdkv transport."""
