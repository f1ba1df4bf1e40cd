"""Cluster what-if simulator (``capctl sim``) reusing the simulated driver physics and the real allocator."""
