"""Which address a member binds and which it tells its peers: its own, never the controller's.

Every trainer rank and engine rank runs a transport endpoint (the `tcp` backend listens on it;
`ibverbs` bootstraps its queue pairs through it; `ucx` and `nixl` use it to decide whether the
member is on loopback). `member_address` resolves the two addresses of one member from its own
settings, in this order:

1. ``listen_host`` set to an address: bind it; advertise ``advertise_host`` if set, else the
   same address.
2. ``listen_host`` set to a wildcard (``0.0.0.0`` or ``::``): bind every interface; advertise
   ``advertise_host`` if set, else the address this host routes to the control plane from.
3. ``listen_host`` unset (the default): the address this host routes to the control plane from
   (`route_address`), bound and advertised. On one machine with the control plane on loopback
   that is ``127.0.0.1``, as before; on a cluster each member finds its own interface, so one
   configuration (for vLLM: one `EngineInitInfo` shared by every worker) serves every host.

The route is the kernel's own choice: a UDP socket `connect()`-ed to the control-plane host
(no packet is sent) and read back with `getsockname()`.
"""

from __future__ import annotations

import dataclasses
import socket

from weight_transfer.errors import ConfigurationError

WILDCARD_HOSTS = frozenset({"0.0.0.0", "::"})
"""Listen hosts that bind every interface (then the advertised address is resolved)."""

_ROUTE_PROBE_PORT = 9
"""Any port does: connecting a UDP socket only asks the kernel for a route."""


@dataclasses.dataclass(frozen=True, slots=True)
class MemberAddress:
    """The two addresses of one member's transport endpoint."""

    listen_host: str
    """What the member binds."""
    advertise_host: str
    """What the member's endpoint tells its peers to connect to."""


def route_address(control_host: str) -> str:
    """The local address this host uses to reach `control_host` (IPv4 preferred).

    Raises:
        ConfigurationError: the host does not resolve, or no route leads to it.
    """
    host = "127.0.0.1" if control_host == "localhost" else control_host
    try:
        infos = socket.getaddrinfo(host, _ROUTE_PROBE_PORT, type=socket.SOCK_DGRAM)
    except socket.gaierror as exc:
        raise ConfigurationError(
            f"control plane host {control_host!r} does not resolve ({exc}); set the member's "
            "listen_host explicitly"
        ) from exc
    infos.sort(key=lambda info: info[0] != socket.AF_INET)
    errors = []
    for family, kind, proto, _, addr in infos:
        with socket.socket(family, kind, proto) as probe:
            try:
                probe.connect(addr)
            except OSError as exc:
                errors.append(f"{addr[0]}: {exc.strerror or exc}")
                continue
            return str(probe.getsockname()[0])
    raise ConfigurationError(
        f"no route from this host to the control plane host {control_host!r} "
        f"({'; '.join(errors)}); set the member's listen_host explicitly"
    )


def check_host_settings(listen_host: object, advertise_host: object) -> None:
    """Validate a member's two settings as a config's `__post_init__` does.

    Raises:
        ConfigurationError: (a ValueError) a setting that is neither None nor a non-empty string,
            or a wildcard `advertise_host`.
    """
    for what, value in (("listen_host", listen_host), ("advertise_host", advertise_host)):
        if value is not None and (not isinstance(value, str) or not value.strip()):
            raise ConfigurationError(
                f"{what} must be a non-empty address string or unset, got {value!r}"
            )
    if advertise_host in WILDCARD_HOSTS:
        raise ConfigurationError(
            f"advertise_host {advertise_host!r} is a wildcard: peers need an address to reach"
        )


def member_address(
    control_host: str, listen_host: str | None = None, advertise_host: str | None = None
) -> MemberAddress:
    """Resolve one member's bound and advertised addresses (the rules in the module docstring).

    Args:
        control_host: the control plane's address (trainer rank 0's host).
        listen_host: the member's own setting: an address, a wildcard, or None for the route.
        advertise_host: the member's own setting: what peers connect to, or None.

    Raises:
        ConfigurationError: an empty setting, or no route to `control_host` where one is needed.
    """
    check_host_settings(listen_host, advertise_host)
    if listen_host is None:
        own = route_address(control_host)
        return MemberAddress(listen_host=own, advertise_host=advertise_host or own)
    if listen_host == "localhost":
        listen_host = "127.0.0.1"
    if listen_host in WILDCARD_HOSTS:
        return MemberAddress(
            listen_host=listen_host, advertise_host=advertise_host or route_address(control_host)
        )
    return MemberAddress(listen_host=listen_host, advertise_host=advertise_host or listen_host)


__all__ = [
    "WILDCARD_HOSTS",
    "MemberAddress",
    "check_host_settings",
    "member_address",
    "route_address",
]
