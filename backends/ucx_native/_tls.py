"""Which of a UCX build's transports a configuration enables, and the refusals built on that.

UCX itself, given a `UCX_TLS` lane it does not have, warns ("transport 'rc_verbs' is not
available, please use one or more of: ...") and carries on over what is left, TCP included;
this module makes that a refusal. `enabled` repeats UCP's own selection
(`ucp_is_resource_enabled` in `src/ucp/core/ucp_context.c`, the same rules in 1.13 and 1.22):
a resource is enabled when its device is in the `UCX_<TYPE>_DEVICES` list of its device type
(or that list is `all`) and its transport is enabled by `UCX_TLS`, which is `all`, a list of
names, or `^` and a list of names to leave out. A name is a transport (`rc_verbs`), a transport
with a leading backslash (that transport only, never an alias), a transport with `:aux` (for
UCP's wireup messages only), or an alias (`ALIASES`: `rc`, `ud`, `dc`, `ib`, `sm`/`shm`,
`cuda`, ...), which enables its members (an `:aux` member only for wireup).

`check` returns the one line to refuse a configuration with, or None:
- a lane of an allow list that enables nothing in this build ("not available"), or nothing on
  the configured devices;
- a list that enables nothing at all;
- rc lanes (which UCP connects endpoint to endpoint) without ud, the lane UCP sends their
  wireup messages over: such an endpoint never connects ("Destination is unreachable");
- where the kernel lists an RDMA device, network lanes that are tcp only, unless the caller
  allows it: data between hosts would silently run over TCP.

Pure functions over strings and `_uct.Resource` lists: no library is loaded here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence

from weight_transfer.backends.ucx_native._uct import Resource

__all__ = [
    "ALIASES",
    "AllowList",
    "check",
    "enabled",
    "is_one_sided",
    "needs_wireup_reply",
    "parse",
    "summary",
]

ALIASES: dict[str, tuple[str, ...]] = {
    "mm": ("posix", "sysv", "xpmem"),
    "sm": ("posix", "sysv", "xpmem", "knem", "cma"),
    "shm": ("posix", "sysv", "xpmem", "knem", "cma"),
    "ib": (
        "rc_verbs",
        "ud_verbs",
        "rc_mlx5",
        "ud_mlx5",
        "dc_mlx5",
        "gga_mlx5",
        "ud_mlx5:aux",
        "ud_verbs:aux",
        "srd",
        "rc_gda",
    ),
    "ud_v": ("ud_verbs",),
    "ud_x": ("ud_mlx5",),
    "ud": ("ud_mlx5", "ud_verbs"),
    "rc_v": ("rc_verbs", "ud_verbs:aux"),
    "rc_x": ("rc_mlx5", "ud_mlx5:aux"),
    "rc": ("rc_mlx5", "ud_mlx5:aux", "rc_verbs", "ud_verbs:aux"),
    "dc": ("dc_mlx5", "ud_mlx5:aux"),
    "dc_x": ("dc_mlx5", "ud_mlx5:aux"),
    "ugni": ("ugni_smsg", "ugni_udt:aux", "ugni_rdma"),
    "cuda": ("cuda_copy", "cuda_ipc", "gdr_copy"),
    "rocm": ("rocm_copy", "rocm_ipc", "rocm_gdr"),
    "ze": ("ze_copy", "ze_ipc", "ze_gdr"),
    "gaudi": ("gaudi_gdr",),
    "gga": ("gga_mlx5",),
}
"""UCP's transport aliases (`ucp_tl_aliases`), the union of UCX 1.13's table and 1.22's. Later
releases only added names (`ze` in 1.17, `gga` in 1.19, `gaudi` in 1.21; `ib` grew `gga_mlx5`,
`srd`, `rc_gda` and its ud members as auxiliaries): a member a build lacks enables nothing, so
the union decides the same as each release's own table for the transports that build has."""

ALL = "all"
_DEVICE_LISTS = {
    "net": "NET_DEVICES",
    "shm": "SHM_DEVICES",
    "acc": "ACC_DEVICES",
    "self": "SELF_DEVICES",
}
_P2P_LANES = frozenset({"rc_verbs", "rc_mlx5", "rc_gda"})
"""Lanes UCP connects endpoint to endpoint: the peer answers a wireup message first."""
_WIREUP_LANES = frozenset({"ud_verbs", "ud_mlx5"})
"""Lanes UCP takes as the auxiliary lane of an rc connection: its wireup criteria want a
transport that connects to an interface and runs its callbacks asynchronously, which ud has and
tcp has not (1.13 in the Soft-RoCE VM, `UCX_TLS=rc_verbs,tcp`: "no auxiliary transport")."""
_VERBS_COMPONENTS = frozenset({"ib", "gga"})
_RDMA_ONE_SIDED = frozenset({"rc_verbs", "rc_mlx5", "dc_mlx5", "gga_mlx5", "srd", "cuda_ipc"})
"""Lanes whose puts run without the target's CPU in every UCX this binding supports."""


@dataclasses.dataclass(frozen=True, slots=True)
class AllowList:
    """A parsed `UCX_TLS` value."""

    mode: str
    """`all`, `allow` (only the names) or `negate` (everything but the names)."""
    names: tuple[str, ...] = ()


def parse(value: str) -> AllowList:
    """Parse a `UCX_TLS` value (`all`, `a,b`, `^a,b`), as UCX's allow-list parser does."""
    text = value.strip()
    mode = "allow"
    if text.startswith("^"):
        mode, text = "negate", text[1:]
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    if mode == "allow" and (not names or ALL in names):
        return AllowList("all")
    return AllowList(mode, names)


def _bare(name: str) -> tuple[str, bool, bool]:
    """(name without decorations, strict: had a leading backslash, aux: had `:aux`)."""
    strict = name.startswith("\\")
    if strict:
        name = name[1:]
    aux = name.endswith(":aux")
    if aux:
        name = name[: -len(":aux")]
    return name, strict, aux


def _named(tl: str, names: Iterable[str], *, allow_strict: bool) -> bool | None:
    """Whether `names` names `tl` directly: True (as a lane), False (as `:aux` only), or None."""
    result: bool | None = None
    for name in names:
        bare, strict, aux = _bare(name)
        if bare == tl and (allow_strict or not strict):
            if not aux:
                return True
            result = False
    return result


def _tl_state(tl: str, allow: AllowList) -> str | None:
    """`lane`, `aux` (wireup only) or None (disabled), as UCP's
    `ucp_is_resource_in_transports_list` decides."""
    if allow.mode == "all":
        return "lane"
    direct = _named(tl, allow.names, allow_strict=True)
    if direct is not None:
        if allow.mode == "negate":
            return None
        return "lane" if direct else "aux"
    for alias, members in ALIASES.items():
        member = _named(tl, members, allow_strict=True)
        if member is None:
            continue
        if any(_bare(n)[0] == alias and not _bare(n)[1] for n in allow.names):
            if allow.mode == "negate":
                return None
            return "lane" if member else "aux"
    return "lane" if allow.mode == "negate" else None


def _device_on(resource: Resource, values: Mapping[str, str]) -> bool:
    key = _DEVICE_LISTS.get(resource.device_type)
    if key is None:
        return True
    listed = [d.strip() for d in values.get(key, ALL).split(",") if d.strip()]
    return ALL in listed or resource.device in listed


@dataclasses.dataclass(frozen=True, slots=True)
class Enabled:
    """A resource the configuration enables, and how."""

    resource: Resource
    aux: bool
    """For UCP's wireup messages only (an `:aux` name or an alias's auxiliary member)."""


def enabled(resources: Sequence[Resource], values: Mapping[str, str]) -> list[Enabled]:
    """The resources `values` (`TLS` and the `*_DEVICES` lists, UCX names without `UCX_`)
    enables, as UCP would."""
    allow = parse(values.get("TLS", ALL))
    out = []
    for r in resources:
        state = _tl_state(r.tl, allow)
        if state is not None and _device_on(r, values):
            out.append(Enabled(r, aux=state == "aux"))
    return out


def summary(resources: Sequence[Resource]) -> str:
    """`rc_verbs (rxe0:1), tcp (eth0, lo), cma`: transports with their devices."""
    by_tl: dict[str, list[str]] = {}
    for r in resources:
        by_tl.setdefault(r.tl, [])
        if r.device_type == "net" and r.device not in by_tl[r.tl]:
            by_tl[r.tl].append(r.device)
    return ", ".join(f"{tl} ({', '.join(devs)})" if devs else tl for tl, devs in by_tl.items())


def _lanes_of(name: str) -> tuple[set[str], bool]:
    """(transports a `UCX_TLS` name enables as lanes, whether it is an alias)."""
    bare, strict, _ = _bare(name)
    if not strict and bare in ALIASES:
        return {_bare(m)[0] for m in ALIASES[bare] if not _bare(m)[2]}, True
    return {bare}, False


def check(
    resources: Sequence[Resource],
    values: Mapping[str, str],
    *,
    build: str,
    rdma_devices: Sequence[str],
    allow_tcp_only: bool,
) -> str | None:
    """Why this configuration must be refused on this build, or None (see the module doc).

    Args:
        resources: The build's transport resources (`_uct.list_resources`).
        values: The effective UCX configuration (`TLS`, `NET_DEVICES`, ...).
        build: How to name the build in a message (`UCX 1.22.0 from library=wheel (...)`).
        rdma_devices: The RDMA devices the kernel lists.
        allow_tcp_only: The caller accepts tcp-only network lanes on a host with RDMA.
    """
    tls = values.get("TLS", ALL)
    allow = parse(tls)
    has = summary(resources) or "no transports at all"
    on = enabled(resources, values)
    if allow.mode == "allow":
        present = {r.tl for r in resources}
        on_tls = {e.resource.tl for e in on}
        for name in allow.names:
            lanes, alias = _lanes_of(name)
            what = f"UCX_TLS lane {name!r}" + (
                f" (alias of {', '.join(sorted(lanes))})" if alias else ""
            )
            if not lanes & present:
                return f"ucx: {what} is not available from {build} on this host; it has: {has}"
            if not lanes & on_tls:
                devices = sorted({r.device for r in resources if r.tl in lanes})
                lists = ", ".join(
                    f"UCX_{k}={values.get(k, ALL)}"
                    for k in sorted(
                        {_DEVICE_LISTS[r.device_type] for r in resources if r.tl in lanes}
                    )
                )
                return (
                    f"ucx: {what} runs on {', '.join(devices)}, none of which {lists} allows "
                    f"({build})"
                )
    if not on:
        return f"ucx: UCX_TLS={tls} enables no transport of {build}; it has: {has}"
    lanes = {e.resource.tl for e in on if not e.aux}
    net = {e.resource.tl for e in on if e.resource.device_type == "net"}
    if lanes & _P2P_LANES and not net & _WIREUP_LANES:
        return (
            f"ucx: UCX_TLS={tls} leaves UCP no lane for its wireup messages: "
            f"{', '.join(sorted(lanes & _P2P_LANES))} connects endpoint to endpoint, after the "
            "peers exchanged addresses over ud; add ud_verbs "
            "(UCX_TLS=rc_verbs,ud_verbs) or write the alias rc, which brings ud as an "
            "auxiliary lane"
        )
    net_lanes = [e.resource for e in on if e.resource.device_type == "net" and not e.aux]
    verbs = [r for r in net_lanes if r.component in _VERBS_COMPONENTS]
    off_host = [r for r in net_lanes if not _is_loopback_device(r.device)]
    if rdma_devices and off_host and not verbs and not allow_tcp_only:
        return (
            f"ucx: this host has RDMA devices ({', '.join(rdma_devices)}) but {build} would "
            f"carry data between hosts over {summary(off_host)} only, under UCX_TLS={tls}, "
            f"UCX_NET_DEVICES={values.get('NET_DEVICES', ALL)}; choose a build with verbs "
            "(library=system or nixl: docs/ucx.md) and UCX_TLS=rc_verbs,ud_verbs, or set the "
            "option allow_tcp_only=yes"
        )
    return None


def _is_loopback_device(device: str) -> bool:
    return device == "lo" or device.startswith("lo:")


def needs_wireup_reply(on: Sequence[Enabled]) -> bool:
    """Whether an endpoint over these lanes is usable only after the peer answered UCP's wireup
    (rc lanes), so that `connect` should wait for it."""
    return any(e.resource.tl in _P2P_LANES and not e.aux for e in on)


_CMA_ONE_SIDED_SINCE = (1, 16)
"""The first UCX whose default protocols (`UCX_PROTO_ENABLE=y`) put over cma."""


def is_one_sided(
    on: Sequence[Enabled], values: Mapping[str, str], version: tuple[int, int, int]
) -> bool:
    """Whether puts over these lanes run without the target's CPU, on every path they may take.

    RDMA lanes (rc, dc) and cuda_ipc do in every supported UCX. cma (same host) does under
    UCP's newer protocols (`UCX_PROTO_ENABLE=y`, the default from UCX 1.16); with the older
    ones UCP puts over cma, shared memory and tcp are messages that the target's worker must
    progress. Measured on one host: 1.22 (the wheel) and 1.23 (NIXL's) finish writes into a
    stopped process over cma; 1.13 does not (with its experimental `PROTO_ENABLE=y` the
    writer crashed), so before 1.16 cma never counts. Where a lane leaves the host (a network
    device other than `lo`), puts to another host are one-sided only over an RDMA lane.
    """
    lanes = [e.resource for e in on if not e.aux]
    off_host = {r.tl for r in lanes if r.device_type == "net" and not _is_loopback_device(r.device)}
    if off_host:
        return bool(off_host & _RDMA_ONE_SIDED)
    tls = {r.tl for r in lanes}
    if tls & _RDMA_ONE_SIDED:
        return True
    new_protocols = values.get("PROTO_ENABLE", "n").lower() in ("y", "yes", "on", "1")
    return "cma" in tls and new_protocols and version[:2] >= _CMA_ONE_SIDED_SINCE


UD_GRH_FIX_SINCE = (1, 19)
"""UCX before 1.19 tells IPv4 from IPv6 RoCE packets on a ud_verbs receive by the work
completion's service level, which only Mellanox devices fill: on any other RoCE device
(Soft-RoCE's rxe among them) a ud packet whose GID is IPv4 is never matched, every wireup over
ud times out, and UCX aborts the process ("UD endpoint ... unhandled timeout error"). Fixed in
1.19 (openucx/ucx 7de57ad9, "Use GRH to detect address family on non-Mellanox hardware").
Measured with Debian's 1.13.1 in the Soft-RoCE VM: its own `ucx_perftest` over
`rc_verbs,ud_verbs` fails with the default GID (IPv4, index 1) and runs with
`UCX_IB_GID_INDEX=0` (the port's IPv6 link-local GID), on one device and across the veth."""

_IPV4_MAPPED = "0000:0000:0000:0000:0000:ffff:"


@dataclasses.dataclass(frozen=True, slots=True)
class RocePort:
    """What the kernel says about an RDMA port (`/sys/class/infiniband/<dev>/ports/<n>`)."""

    device: str
    port: int
    link_layer: str
    """`Ethernet` (RoCE) or `InfiniBand`."""
    gids: tuple[str, ...]
    """The GID table by index, as sysfs prints it (`fe80:0000:...`); all-zero entries kept."""


def ud_gid_refusal(
    on: Sequence[Enabled],
    values: Mapping[str, str],
    *,
    version: tuple[int, int, int],
    ports: Mapping[str, RocePort],
    gid_index: str | None,
    build: str,
) -> str | None:
    """Why ud_verbs cannot work here with this build and GID choice (`UD_GRH_FIX_SINCE`), or
    None.

    Args:
        on: The enabled resources.
        values: The effective configuration (an `IB_GID_INDEX` given as an option is in it).
        version: The build's version.
        ports: The kernel's RDMA ports by UCX device name (`rxe0:1`).
        gid_index: `UCX_IB_GID_INDEX` of the process environment, if set (UCX reads it there
            itself; an option wins over it).
        build: How to name the build.
    """
    if version[:2] >= UD_GRH_FIX_SINCE:
        return None
    chosen = values.get("IB_GID_INDEX") or gid_index or "auto"
    for e in on:
        r = e.resource
        port = ports.get(r.device)
        if r.tl != "ud_verbs" or port is None or port.link_layer != "Ethernet":
            continue
        if port.device.startswith(("mlx4", "mlx5")):
            continue  # Mellanox devices fill the service level: unaffected
        ipv6 = [
            i
            for i, gid in enumerate(port.gids)
            if gid.strip("0:") and not gid.startswith(_IPV4_MAPPED)
        ]
        if chosen.isdigit() and int(chosen) in ipv6:
            continue
        hint = (
            f"set IB_GID_INDEX={ipv6[0]} (an IPv6 GID of {r.device}: {port.gids[ipv6[0]]})"
            if ipv6
            else f"{r.device} has no IPv6 GID: use UCX 1.19 or later (library=nixl, or a folder)"
        )
        what = "UCX's own choice of GID" if chosen == "auto" else f"IB_GID_INDEX={chosen}"
        return (
            f"ucx: ud_verbs on {r.device} cannot work with {build}: before UCX 1.19 ud receives "
            f"RoCE packets from IPv4 GIDs only on Mellanox devices, and {what} is not an IPv6 "
            f"GID of this port (every wireup over ud would time out and UCX abort the process); "
            f"{hint}"
        )
    return None
