"""Coordinator daemon: the reconcile loop on the head node."""
