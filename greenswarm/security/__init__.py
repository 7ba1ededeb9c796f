"""Swarm admission: authority keys and membership certificates (issue #7)."""
