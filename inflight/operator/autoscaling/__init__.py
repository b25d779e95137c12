"""Autoscaling: the pure decision, the builtin actuator, its loop, and the pods' /metrics it reads."""
