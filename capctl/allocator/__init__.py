"""Convex allocation of a power budget across GPUs (pure functions: state in, caps out).

Public API: :class:`AllocationProblem` / :class:`AllocationResult` (problem.py), ``solve`` (fast.py,
exact dual method), ``ReferenceSolver`` / ``solve_reference`` (reference.py, cvxpy + Clarabel),
rate curves (curves.py), thermal ceiling and online RC fit (thermal.py). Math: docs/allocation.md.
"""

from .fast import solve
from .problem import AllocationProblem, AllocationResult

__all__ = ["AllocationProblem", "AllocationResult", "solve"]
