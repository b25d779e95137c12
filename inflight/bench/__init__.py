"""Offline throughput benchmark: the fixed workload through inflight and the engines users would pick."""
