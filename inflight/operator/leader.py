"""Leader election on a coordination.k8s.io/v1 Lease, so replicas of the operator never fight.

Each replica tries to hold the Lease `inflight-operator` in its own namespace. Only the holder runs the
reconcilers; the others wait. The holder renews every `renew_seconds`; a Lease not renewed for
`lease_seconds` may be taken over. Every write is a merge patch that carries the Lease's
`metadata.resourceVersion`, which the API server treats as a precondition (409 when someone else wrote
first), so two replicas can never both believe they won. A holder that cannot renew within
`lease_seconds` stops (its pod restarts as a follower) rather than risk acting as a second leader.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import aiohttp

from inflight.operator import kube
from inflight.operator.api import resources

log = logging.getLogger("inflight.operator.leader")

LEASE_NAME = "inflight-operator"


def default_identity() -> str:
    return f"{os.environ.get('POD_NAME') or socket.gethostname()}_{uuid.uuid4().hex[:8]}"


@dataclass
class LeaderElector:
    client: kube.KubeClient
    namespace: str
    identity: str
    name: str = LEASE_NAME
    lease_seconds: int = 15
    renew_seconds: float = 5.0
    retry_seconds: float = 2.0

    def _lease_spec(self, now: datetime, acquired: bool, transitions: int) -> dict[str, Any]:
        spec: dict[str, Any] = {
            "holderIdentity": self.identity,
            "leaseDurationSeconds": self.lease_seconds,
            "renewTime": kube.rfc3339(now, micro=True),
        }
        if acquired:
            spec["acquireTime"] = kube.rfc3339(now, micro=True)
            spec["leaseTransitions"] = transitions
        return spec

    async def try_acquire_or_renew(self) -> bool:
        """One attempt: True when this replica holds the Lease afterwards."""
        now = datetime.now(UTC)
        path = resources.LEASES.path(self.namespace, self.name)
        lease = await self.client.get(path)
        if lease is None:
            body = {
                "apiVersion": "coordination.k8s.io/v1",
                "kind": "Lease",
                "metadata": {"name": self.name, "namespace": self.namespace},
                "spec": self._lease_spec(now, acquired=True, transitions=0),
            }
            try:
                await self.client.create(resources.LEASES.path(self.namespace), body)
            except kube.KubeError as error:
                if error.status == 409:
                    return False
                raise
            return True
        spec = lease.get("spec") or {}
        holder = spec.get("holderIdentity")
        renewed = kube.parse_rfc3339(spec.get("renewTime")) or kube.parse_rfc3339(spec.get("acquireTime"))
        duration = spec.get("leaseDurationSeconds") or self.lease_seconds
        expired = renewed is None or (now - renewed).total_seconds() > duration
        if holder not in (None, "", self.identity) and not expired:
            return False
        taking_over = holder != self.identity
        transitions = int(spec.get("leaseTransitions") or 0) + (1 if taking_over and holder else 0)
        patch = {
            "metadata": {"resourceVersion": lease["metadata"].get("resourceVersion")},
            "spec": self._lease_spec(now, acquired=taking_over, transitions=transitions),
        }
        try:
            await self.client.merge_patch(path, patch)
        except kube.KubeError as error:
            if error.status == 409:  # someone else wrote the Lease first
                return False
            raise
        if taking_over:
            log.info("acquired leadership (Lease %s/%s) as %s", self.namespace, self.name, self.identity)
        return True

    async def acquire(self) -> None:
        """Wait until this replica holds the Lease."""
        logged = False
        while True:
            try:
                if await self.try_acquire_or_renew():
                    return
            except (kube.KubeError, aiohttp.ClientError, TimeoutError) as error:
                log.warning("leader election: %s", error)
            if not logged:
                log.info("another replica leads (Lease %s/%s); waiting", self.namespace, self.name)
                logged = True
            await asyncio.sleep(self.retry_seconds)

    async def hold(self) -> None:
        """Renew until renewal fails for longer than the lease; then return (leadership is lost)."""
        last_renewal = asyncio.get_running_loop().time()
        while True:
            await asyncio.sleep(self.renew_seconds)
            try:
                if await self.try_acquire_or_renew():
                    last_renewal = asyncio.get_running_loop().time()
                    continue
                log.error("lost leadership: another replica holds Lease %s/%s", self.namespace, self.name)
                return
            except (kube.KubeError, aiohttp.ClientError, TimeoutError) as error:
                log.warning("could not renew the Lease: %s", error)
            if asyncio.get_running_loop().time() - last_renewal > self.lease_seconds:
                log.error("could not renew the Lease for %ss; stepping down", self.lease_seconds)
                return
