"""Disagg's Kubernetes side: the DisaggregatedModel API, spec → plan → objects, and the kopf operator.

Importing this package must stay light: no vLLM, no torch, no Kubernetes client at import time.
"""
