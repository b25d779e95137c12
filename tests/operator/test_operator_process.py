"""`inflight operator` as a user runs it: a process, leader election on, against the strict emulator.

The first two calls of the operator on a real cluster (the Lease, then the children) were refused with
415 by kube-apiserver; here they must succeed, each component must name itself in the audit trail, and
a SIGTERM must end the process cleanly: exit 0, no `Unclosed connector` or traceback.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import os
import signal
import sys
from pathlib import Path

import pytest

from inflight.operator.kube import OPERATOR_USER_AGENT

from support.emulated import DEPLOYMENTS, eventually, kubeconfig_cluster

NS = "ns"
KOPF_USER_AGENT = f"kopf/{importlib.metadata.version('kopf')}"  # Kopf posts Events of its own
MODELSERVER = {
    "apiVersion": "inflight.dev/v1alpha1",
    "kind": "ModelServer",
    "metadata": {"name": "tiny"},
    "spec": {
        "model": {"name": "tiny", "source": "builtin:tiny", "maxModelLen": 512},
        "resources": {"gpu": {"count": 0}, "cpu": "1", "memory": "2Gi"},
    },
}


async def test_operator_process_leads_reconciles_and_stops_cleanly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with kubeconfig_cluster(tmp_path, monkeypatch) as cluster:
        created = await cluster.post(
            f"/apis/inflight.dev/v1alpha1/namespaces/{NS}/modelservers", json=MODELSERVER
        )
        assert created.status == 201, await created.text()
        ours = len(cluster.audit)  # the requests from here on are the operator's (and kopf's)
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "inflight.cli",
            "operator",
            "--lease-namespace",
            NS,
            "--liveness",
            "",
            "--metrics-address",
            "",
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        try:
            lease = await eventually(
                lambda: cluster.stored("coordination.k8s.io/v1/leases", NS, "inflight-operator"),
                timeout=120,
                what="the operator's Lease",
            )
            assert lease["spec"]["holderIdentity"]
            await eventually(
                lambda: cluster.stored(DEPLOYMENTS, NS, "tiny"), timeout=120, what="the Deployment"
            )
        finally:
            process.send_signal(signal.SIGTERM)
            output, _ = await asyncio.wait_for(process.communicate(), timeout=120)
        log = output.decode()
        assert process.returncode == 0, log
        assert "Unclosed" not in log and "Traceback" not in log, log
        writes = [
            (agent, path) for agent, method, path in cluster.audit[ours:] if method in ("POST", "PATCH")
        ]
        assert writes and {agent for agent, _ in writes} <= {OPERATOR_USER_AGENT, KOPF_USER_AGENT}, writes
        assert all(agent == OPERATOR_USER_AGENT for agent, path in writes if "/events" not in path), writes
