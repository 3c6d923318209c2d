"""Servers: order the buffer and take batches from it (registry: ``SERVERS``)."""
