"""Helpers the test areas share, importable as `support.*` (`pythonpath = ["tests"]` in pyproject.toml).

kube_emulator and emulated: the kmock API-server adapter and the operator running against it; crd_check:
structural-schema and CEL checks; paged_cases: attention test cases and the dense reference; models: the
cached tiny checkpoints; router_harness, autoscale_harness, demo_server: real servers and operators for
integration tests; fake_hub: a Hugging Face Hub stand-in; monitoring_kit: the chart's monitoring objects
and promtool; held_cli: the CLI with engine steps held on a file (run as a script); browser: headless
Chromium and a running `inflight demo`; paged_model: a model's logits through a paged KV cache.
"""
