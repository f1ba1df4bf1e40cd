"""Reusable test helpers (simulated nodes, processes, clusters)."""
