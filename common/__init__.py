"""pdkv common."""
