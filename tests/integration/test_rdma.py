"""Whole updates across a kernel verbs stack: trainers on one host, engines on another, over rxe.

Runs in the Soft-RoCE VM only (`tests/softroce/run`; elsewhere every test here is skipped with
that reason). The VM wires two "hosts" (tests/softroce/guest.sh): the engines' host is `rxe0`
over `wtveth0` (10.99.0.1), the trainers' is `rxe1` over `wtveth1` (10.99.0.2), and the traffic
between the two addresses crosses the veth pair. Every process is configured through the
public config only (`TransferConfig`: its own `listen_host` and the backend's device options),
as two real hosts would be: FSDP2 trainer ranks (gloo) take AdamW steps and update tp=2
vLLM-layout engines (a BF16 and an FP8 replica) over each backend that speaks verbs
(`ibverbs` through pyverbs, `ucx` on a UCX build with `rc_verbs`, `nixl` with its UCX plugin
on `rc_verbs`). Every update is verified bit for bit against the reference materialization,
and the run must have moved its bytes over RDMA: the engines' rxe device received at least
one packet per path MTU of payload and their veth at least the payload's bytes (a transport
that fell back to TCP or to a same-host copy would fail that)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.test_update_end_to_end import _check
from tests.markers import SoftRoceHost, requires_softroce_hosts, softroce_hosts
from weight_transfer.cli.launch import slow_host_factor
from weight_transfer.cli.run_demo import DemoConfig, run_demo

pytestmark = [pytest.mark.rdma, requires_softroce_hosts]

BACKENDS = ("ibverbs", "ucx", "nixl")
PATH_MTU_BYTES = 4096
"""The largest RoCE path MTU: a write of n bytes is at least n / 4096 packets."""


def transport_options(backend: str, host: SoftRoceHost) -> tuple[tuple[str, str], ...]:
    """The options that put `backend` on `host`'s RDMA device, and on verbs only."""
    if backend == "ibverbs":
        return (("device", host.device),)
    if backend == "ucx":
        # rc needs ud beside it: UCP sends rc's wireup over ud; and Debian's UCX (1.13) takes
        # ud from rxe only over an IPv6 GID, index 0 on rxe (docs/ucx.md).
        return (
            ("library", "system"),
            ("TLS", "rc_verbs,ud_verbs"),
            ("NET_DEVICES", f"{host.device}:1"),
            ("IB_GID_INDEX", "0"),
        )
    if backend == "nixl":
        # NIXL also connects its agent to itself: the self lane.
        return (("UCX_TLS", "rc_verbs,ud_verbs,self"), ("ucx_devices", f"{host.device}:1"))
    raise ValueError(backend)


def wire_counters(host: SoftRoceHost) -> tuple[int, int]:
    """(packets the RDMA device received, bytes its netdev received) so far."""
    port = Path("/sys/class/infiniband") / host.device / "ports" / "1"
    packets = int((port / "hw_counters" / "rcvd_pkts").read_text())
    nbytes = int((Path("/sys/class/net") / host.netdev / "statistics" / "rx_bytes").read_text())
    return packets, nbytes


def two_host_demo(backend: str, **kwargs: object) -> DemoConfig:
    hosts = softroce_hosts()
    assert hosts is not None
    engines, trainers = hosts
    return DemoConfig(
        backend=backend,
        control_host=trainers.address,
        trainer_host=trainers.address,
        engine_host=engines.address,
        trainer_transport_options=transport_options(backend, trainers),
        engine_transport_options=transport_options(backend, engines),
        timeout_s=120 * slow_host_factor(),
        **kwargs,  # type: ignore[arg-type]
    )


@pytest.mark.timeout(3600)
@pytest.mark.parametrize("backend", BACKENDS)
def test_fsdp2_trainers_update_bf16_and_fp8_engines_on_another_host(backend: str) -> None:
    """Two tp=2 engine replicas on the engines' host, one BF16 and one FP8 (one schedule feeds
    both), two FSDP2 trainer ranks on the trainers' host; two verified updates."""
    hosts = softroce_hosts()
    assert hosts is not None
    engines = hosts[0]
    packets0, bytes0 = wire_counters(engines)
    steps = 2
    cfg = two_host_demo(
        backend,
        replica_fp8=(False, True),
        train_ranks=2,
        engine_ranks=2,
        steps=steps,
        return_tensors=True,
    )
    result = run_demo(cfg)
    _check(result, steps=steps, engines=cfg.num_engines)
    packets1, bytes1 = wire_counters(engines)
    payload = sum(u.nbytes for u in result.updates)
    assert payload > 0
    assert bytes1 - bytes0 >= payload, (bytes1 - bytes0, payload)
    assert packets1 - packets0 >= payload // PATH_MTU_BYTES, (packets1 - packets0, payload)
