"""Configuration dataclasses of every runtime component, and their TOML / CLI mapping.

One frozen dataclass per component, units in field names, a one-line docstring per field,
`__post_init__` raising `ConfigurationError` (a `ValueError`) on bad values. `TransferConfig`
holds them all and is what `WeightSender`, `WeightReceiver` and the vLLM plug-in take; a TOML
file maps onto it completely (`load_toml`; every table and key is a field, anything else is
refused naming it), CLI flags fill the same dataclasses (`config_from_mapping`), and
`config_to_mapping` is the inverse. Nothing is configurable in only one of them. The library
never reads environment variables.
"""

from __future__ import annotations

import dataclasses
import math
import secrets
import string
import sys
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from weight_transfer.addresses import check_host_settings, member_address
from weight_transfer.backends.base import BACKENDS, TransportConfig
from weight_transfer.errors import ConfigurationError
from weight_transfer.planner.plan import PlannerConfig
from weight_transfer.planner.presets.models import MOE_LAYOUTS

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib


MIN_TOKEN_BITS = 128
"""Least randomness a control plane token must carry (as `token_bits` estimates it)."""

PUBLISHED_SAMPLE_TOKENS = frozenset({"xOsNmkg5xHsBzlmZY7kjnbNV9YnevoHswB73Axu9t-8"})
"""Tokens this project prints as samples (the TOML example of docs/configuration.md): anyone can
read them, so none is accepted as a real one. tests/unit/test_config.py checks that every sample
token in the README and docs is listed here."""


def new_token() -> str:
    """A fresh control plane token: 256 random bits, URL-safe base64 (43 characters)."""
    return secrets.token_urlsafe(32)


def token_bits(token: str) -> float:
    """An upper estimate of the randomness in `token`, in bits.

    Length times log2 of the alphabet the characters come from (hex digits 16; otherwise the
    union of the classes used: lower case 26, upper case 26, digits 10, other printable 33).
    A string that uses far fewer distinct characters than a random one of its length would
    ("aaaa...", a repeated word) counts only its distinct characters. A token from `new_token`
    (or `secrets.token_hex(16)`, `openssl rand -hex 16`) passes 128 bits; short or repetitive
    ones do not. (A long typed passphrase can still pass: use a generated token.)
    """
    if not token:
        return 0.0
    chars = set(token)
    if chars <= set(string.hexdigits):
        alphabet = 16
    else:
        classes = (string.ascii_lowercase, string.ascii_uppercase, string.digits)
        alphabet = sum(len(c) for c in classes if chars & set(c))
        if chars - set("".join(classes)):
            alphabet += 33
    expected = alphabet * (1 - (1 - 1 / alphabet) ** len(token))
    if len(chars) < 0.6 * expected:
        return len(chars) * math.log2(alphabet)
    return len(token) * math.log2(alphabet)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ControlPlaneConfig:
    """Where the control plane (a torch.distributed TCPStore) lives and how to join it."""

    host: str = "127.0.0.1"
    """Address of the store; the server binds it (loopback by default)."""
    port: int = 29700
    """TCP port of the store."""
    token: str = dataclasses.field(default="", repr=False)
    """Shared secret every member must know, with at least 128 bits of randomness (make one
    with `weight-transfer token`); keys are derived from it. No default. Never shown by repr."""
    timeout_s: float = 60.0
    """Longest any control-plane wait may take (joining, manifests, signals)."""
    session: str = "default"
    """Namespace of keys, so several transfers can share one store."""
    store_memory_bytes: int = 1 << 30
    """Most memory the store's process (the controller's side) may hold in values; past it the
    store refuses writes. Size it to the schedule: every rank's part is stored once."""
    store_max_connections: int = 4096
    """Most connections the store serves at once (each member holds one or two)."""
    presence_port: int = 0
    """TCP port on `host` where the controller hears whether trainer ranks are alive (each
    rank not hosting the controller holds one connection there; 0: one the kernel picks). Open
    it between the trainer hosts as the store's port."""

    def __post_init__(self) -> None:
        if self.store_memory_bytes <= 0:
            raise ConfigurationError("store_memory_bytes must be positive")
        if self.store_max_connections <= 0:
            raise ConfigurationError("store_max_connections must be positive")
        if not self.host:
            raise ConfigurationError("control plane host must be non-empty")
        if not 0 < self.port < 65536:
            raise ConfigurationError(f"control plane port {self.port} is out of range")
        if not 0 <= self.presence_port < 65536:
            raise ConfigurationError(f"presence port {self.presence_port} is out of range")
        if not self.token:
            raise ConfigurationError(
                "control plane token is required (there is no default): make one with "
                "`weight-transfer token` and give every member the same"
            )
        if self.token in PUBLISHED_SAMPLE_TOKENS:
            raise ConfigurationError(
                "control plane token is the sample printed in this project's docs, which anyone "
                "can read: make your own with `weight-transfer token`"
            )
        bits = token_bits(self.token)
        if bits < MIN_TOKEN_BITS:
            raise ConfigurationError(
                f"control plane token carries about {bits:.0f} bits of randomness, fewer than "
                f"the {MIN_TOKEN_BITS} required: make one with `weight-transfer token`"
            )
        if self.timeout_s <= 0:
            raise ConfigurationError("timeout_s must be positive")
        if not self.session or "/" in self.session:
            raise ConfigurationError("session must be non-empty and contain no '/'")


SNAPSHOT_MEMORY = ("auto", "device", "host")
"""Where a delta sender keeps its snapshot (`DeltaConfig.snapshot_memory`)."""

DELTA_KERNELS = ("auto", "triton", "cuda")
"""GPU kernels of delta updates (`DeltaConfig.kernels`, `ReceiverConfig.patch_kernels`;
`weight_transfer.kernels.delta.KERNELS`)."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class DeltaConfig:
    """Delta updates (docs/delta.md): send only the engine bytes that changed.

    The engines must have registered a patch region (`ReceiverConfig.patch_region_bytes`);
    a trainer rank whose engines have none sends full updates.
    """

    enabled: bool = False
    """Send deltas after the first full update (off: every update is full)."""
    anchor_every_updates: int = 0
    """Send a full update every this many updates (0: only when needed)."""
    max_wire_fraction: float = 0.5
    """Send a full update next when the last delta put more than this fraction of a full
    update's bytes on the wire (a delta that dense is not faster)."""
    snapshot_memory: str = "auto"
    """Where the snapshot of the bytes last sent lives: "device" (the rank's GPU), "host"
    (pinned host memory), or "auto" (the GPU when it fits `snapshot_device_budget_bytes`)."""
    snapshot_device_budget_bytes: int = 0
    """Largest snapshot "auto" keeps on the GPU (0: always host)."""
    apply_timeout_s: float = 300.0
    """Longest an update waits for the engines to apply the previous delta before it writes."""
    full_when_slower: bool = True
    """Send full updates while the last delta took longer than the last full update (each
    rank times its own `WeightSender.update` calls); try a delta again after
    `retry_delta_after_updates` of them. Where a full update runs near memory speed (one GPU,
    NVLink) a delta is slower at any density, and this keeps delta mode from costing time."""
    retry_delta_after_updates: int = 20
    """Full updates sent for being faster before a delta is tried again (>= 1)."""
    verify: bool = False
    """After every update (delta or full) compare each engine's bytes with what the trainer
    ranks sent, by keyed position digests (one read of every written byte on both sides); the
    next update raises on a mismatch, naming the engines, and the one after it is full."""
    kernels: str = "auto"
    """GPU kernels that count and encode the changes (`DELTA_KERNELS`, set for the process
    when the rank's delta session starts): "cuda" the CUDA C kernels (need CuPy:
    `weight-transfer[cuda12]` or `[cuda13]`), "triton" the Triton kernels, "auto" CUDA C
    where CuPy imports and compiles them, else Triton. Both write the same bytes
    (docs/delta.md)."""

    def __post_init__(self) -> None:
        if self.kernels not in DELTA_KERNELS:
            raise ConfigurationError(
                f"delta.kernels must be one of {DELTA_KERNELS}, got {self.kernels!r}"
            )
        if self.anchor_every_updates < 0:
            raise ConfigurationError("delta.anchor_every_updates must be >= 0")
        if not 0.0 < self.max_wire_fraction <= 1.0:
            raise ConfigurationError("delta.max_wire_fraction must be in (0, 1]")
        if self.snapshot_memory not in SNAPSHOT_MEMORY:
            raise ConfigurationError(
                f"delta.snapshot_memory must be one of {SNAPSHOT_MEMORY}, "
                f"got {self.snapshot_memory!r}"
            )
        if self.snapshot_device_budget_bytes < 0:
            raise ConfigurationError("delta.snapshot_device_budget_bytes must be >= 0")
        if self.apply_timeout_s <= 0:
            raise ConfigurationError("delta.apply_timeout_s must be positive")
        if self.retry_delta_after_updates < 1:
            raise ConfigurationError("delta.retry_delta_after_updates must be >= 1")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SenderConfig:
    """Settings of a trainer rank's `WeightSender` (its memory budget is the planner's:
    `PlannerConfig.memory_budget_bytes`, which the schedule carries to every rank)."""

    update_timeout_s: float = 300.0
    """Longest one update may take on this rank before it fails."""
    record_trace: bool = True
    """Record per-task stage times (cheap) for `WeightSender.trace_events`."""
    delta: DeltaConfig = dataclasses.field(default_factory=DeltaConfig)
    """Delta updates (`[sender.delta]` in TOML)."""
    table_quantize: bool = True
    """On CUDA, FP8 graph groups quantize through one table-kernel launch per block shape and
    dtype; False captures one kernel per quantize call instead (the benchmarks' comparison)."""

    def __post_init__(self) -> None:
        if self.update_timeout_s <= 0:
            raise ConfigurationError("update_timeout_s must be positive")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ReceiverConfig:
    """Settings of an engine rank's `WeightReceiver`."""

    allow_unwritten: bool = False
    """If False, every tensor handed to the receiver must be written by some recipe."""
    patch_region_bytes: int = 0
    """Delta updates: bytes of the patch region registered once beside the weights (0: none;
    the trainers then send full updates). Split evenly over the trainer ranks' slots."""
    patch_kernels: str = "auto"
    """GPU kernels that apply patches (`DELTA_KERNELS`, set for the process when the patch
    region is registered; as `DeltaConfig.kernels`)."""
    update_window: bool = False
    """Trainers write into this engine only inside an update window it opened
    (`WeightReceiver.begin_update`, `wait_for_version` or `apply_delta` open one, after closing
    the serving gate), so the gate is closed whenever a byte of an update lands. Every update
    then waits (up to the trainers' `update_timeout_s`) until each such engine of the plan
    opened one, and fails with nothing written, naming those that did not. Off: the engine
    stays passive and the trainers write whenever they update (the gate closes only at the
    engine's own call)."""

    def __post_init__(self) -> None:
        if self.patch_region_bytes < 0:
            raise ConfigurationError("patch_region_bytes must be >= 0")
        if self.patch_kernels not in DELTA_KERNELS:
            raise ConfigurationError(
                f"receiver.patch_kernels must be one of {DELTA_KERNELS}, got {self.patch_kernels!r}"
            )


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ControllerConfig:
    """Settings of the `Controller` (hosted by trainer rank 0's `WeightSender` unless one is
    made by hand; `TransferConfig.controller_config` derives it)."""

    num_trainer_ranks: int
    """Trainer ranks that will send."""
    num_engines: int
    """Engine ranks that will receive (all replicas together)."""
    planner: PlannerConfig = dataclasses.field(default_factory=PlannerConfig)
    """Planner settings (memory budget, write sizes)."""

    def __post_init__(self) -> None:
        if self.num_trainer_ranks <= 0:
            raise ConfigurationError("num_trainer_ranks must be positive")
        if self.num_engines <= 0:
            raise ConfigurationError("num_engines must be positive")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class VllmConfig:
    """Settings of the vLLM plug-in (`weight_transfer.engines.vllm`): the `[vllm]` table."""

    engine_prefix: str = "vllm"
    """vLLM worker ranks are named `{engine_prefix}/rank{global worker rank}` (one prefix per
    vLLM deployment sharing a control plane)."""
    publish_digests: bool = False
    """Verification mode: after each update every vLLM worker publishes a sha256 of every tensor
    it received (one read of all of them) for `Controller.verify`."""
    hf_moe_layout: str = "per_expert"
    """How the trainer holds MoE experts: "per_expert" (HF checkpoints) or "fused"
    (transformers >= 5 modules)."""

    def __post_init__(self) -> None:
        if not self.engine_prefix or "/" in self.engine_prefix:
            raise ConfigurationError("vllm.engine_prefix must be non-empty and contain no '/'")
        if self.hf_moe_layout not in MOE_LAYOUTS:
            raise ConfigurationError(
                f"vllm.hf_moe_layout must be one of {', '.join(MOE_LAYOUTS)}, "
                f"got {self.hf_moe_layout!r}"
            )


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class TransferConfig:
    """Everything a deployment configures; the one config both sides take, as a TOML file maps it.

    ```toml
    transport = "tcp"            # loopback | tcp | ucx | nixl | ibverbs
    num_engines = 8              # engine ranks, all replicas (the trainer side needs it)
    # listen_host = "10.0.0.2"   # this member's address (default: its route to control.host)
    [control]
    host = "10.0.0.1"
    port = 29700
    token = "..."                # `weight-transfer token`
    [planner]
    memory_budget_bytes = 1073741824
    [sender]
    update_timeout_s = 300.0
    [receiver]
    allow_unwritten = false
    [vllm]
    engine_prefix = "vllm"
    [transport_options]
    UCX_TLS = "rc,cuda_ipc"
    ```
    """

    transport: str = "loopback"
    """Backend name."""
    transport_options: tuple[tuple[str, str], ...] = ()
    """Backend-specific options (key, value)."""
    connect_timeout_s: float = 30.0
    """How long connecting to a peer may take."""
    num_engines: int | None = None
    """Engine ranks that receive, all replicas together. The trainer rank that hosts the
    controller (rank 0) needs it; engines ignore it."""
    listen_host: str | None = None
    """Address this member's transport binds: an address, ``0.0.0.0`` / ``::`` for every
    interface, or unset for the address this host routes to `control.host` from
    (`weight_transfer.addresses`). Each host's own file sets its own."""
    advertise_host: str | None = None
    """Address peers are told to connect to (NAT, a wildcard listen_host); unset: the bound
    address, or for a wildcard the routed one."""
    control: ControlPlaneConfig
    """Control plane (required: its token has no default)."""
    sender: SenderConfig = dataclasses.field(default_factory=SenderConfig)
    """Trainer-side settings."""
    receiver: ReceiverConfig = dataclasses.field(default_factory=ReceiverConfig)
    """Engine-side settings."""
    planner: PlannerConfig = dataclasses.field(default_factory=PlannerConfig)
    """Planner settings, with the one memory budget per trainer rank."""
    vllm: VllmConfig = dataclasses.field(default_factory=VllmConfig)
    """vLLM plug-in settings."""

    def __post_init__(self) -> None:
        if self.transport not in BACKENDS:
            raise ConfigurationError(
                f"unknown transport {self.transport!r}; choose one of {sorted(BACKENDS)}"
            )
        if self.connect_timeout_s <= 0:
            raise ConfigurationError("connect_timeout_s must be positive")
        if self.num_engines is not None and self.num_engines <= 0:
            raise ConfigurationError("num_engines must be positive")
        # Lists arrive from JSON (the vLLM init info): normalise to the frozen form.
        object.__setattr__(
            self, "transport_options", tuple((str(k), str(v)) for k, v in self.transport_options)
        )
        # The options, checked where the file is read (one line); the member's addresses are
        # resolved only when a process asks for its transport (a route lookup).
        TransportConfig(
            name=self.transport,
            connect_timeout_s=self.connect_timeout_s,
            options=self.transport_options,
        )
        check_host_settings(self.listen_host, self.advertise_host)

    def transport_config(self, device_index: int | None = None) -> TransportConfig:
        """The `TransportConfig` for one process on this host (`device_index`: its CUDA device,
        if any): it binds and advertises this member's own address
        (`weight_transfer.addresses.member_address`).

        Raises:
            ConfigurationError: no route to the control plane host where one is needed.
        """
        own = member_address(self.control.host, self.listen_host, self.advertise_host)
        return TransportConfig(
            name=self.transport,
            device_index=device_index,
            connect_timeout_s=self.connect_timeout_s,
            listen_host=own.listen_host,
            advertise_host=own.advertise_host,
            options=self.transport_options,
        )

    def controller_config(self, num_trainer_ranks: int) -> ControllerConfig:
        """The `ControllerConfig` of the controller trainer rank 0 hosts.

        Raises:
            ConfigurationError: `num_engines` is not set.
        """
        if self.num_engines is None:
            raise ConfigurationError(
                "num_engines is not set: trainer rank 0 hosts the controller and must know how "
                "many engine ranks (all replicas together) receive (TransferConfig.num_engines, "
                "`num_engines = N` in the TOML file)"
            )
        return ControllerConfig(
            num_trainer_ranks=num_trainer_ranks, num_engines=self.num_engines, planner=self.planner
        )


_SCALARS: dict[Any, tuple[type, ...]] = {
    int: (int,),
    float: (int, float),
    str: (str,),
    bool: (bool,),
}
_TYPE_WORDS = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}


def _checked(where: str, tp: Any, value: Any) -> Any:
    """`value` if it has the field's scalar type (so the error names the field, not a `<`)."""
    args = typing.get_args(tp)
    if type(None) in args:  # `int | None`: TOML has no null, so a given value is the int
        (tp,) = (a for a in args if a is not type(None))
    accepted = _SCALARS.get(tp)
    if accepted is None:
        return value
    # bool is an int subclass in Python, but `port = true` is a mistake, not 1.
    if isinstance(value, bool) and tp is not bool or not isinstance(value, accepted):
        raise ConfigurationError(
            f"{where}: expected {_TYPE_WORDS[tp]}, got {type(value).__name__} {value!r}"
        )
    return float(typing.cast(float, value)) if tp is float else value


def _is_config(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _build(cls: type[Any], data: Mapping[str, Any], path: str) -> Any:
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        if key not in fields:
            tables = sorted(k for k in fields if _is_config(hints[k]) or k == "transport_options")
            settings = sorted(k for k in fields if k not in tables)
            if isinstance(value, Mapping):
                raise ConfigurationError(
                    f"{path}: unknown table [{key}]; known tables: "
                    + (", ".join(f"[{t}]" for t in tables) or "none")
                )
            raise ConfigurationError(f"{path}: unknown setting {key!r}; known: {settings}")
        tp = hints[key]
        if _is_config(tp):
            if not isinstance(value, Mapping):
                raise ConfigurationError(f"{path}.{key}: expected a table")
            kwargs[key] = _build(tp, value, f"{path}.{key}")
        elif key == "transport_options":
            if isinstance(value, Mapping):
                kwargs[key] = tuple(sorted((str(k), str(v)) for k, v in value.items()))
            else:
                kwargs[key] = tuple((str(k), str(v)) for k, v in value)
        else:
            kwargs[key] = _checked(f"{path}.{key}", tp, value)
    try:
        return cls(**kwargs)
    except ConfigurationError as exc:
        raise ConfigurationError(f"{path}: {exc}") from None
    except (TypeError, ValueError) as exc:
        raise ConfigurationError(f"{path}: {exc}") from None


def config_from_mapping(data: Mapping[str, Any]) -> TransferConfig:
    """Build a `TransferConfig` from nested plain data (a parsed TOML file or CLI overrides).

    Raises:
        ConfigurationError: unknown tables or keys, or bad values, naming the setting.
    """
    return typing.cast(TransferConfig, _build(TransferConfig, data, "config"))


def config_to_mapping(config: Any) -> dict[str, Any]:
    """The nested plain data of a config (the inverse of `config_from_mapping`; TOML-shaped:
    tables as dicts, `transport_options` as a table, unset optional values left out)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if value is None:
            continue
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            out[f.name] = config_to_mapping(value)
        elif f.name == "transport_options":
            out[f.name] = dict(value)
        else:
            out[f.name] = value
    return out


def read_toml(path: str | Path) -> dict[str, Any]:
    """The plain data of a TOML file (to merge with CLI overrides before building)."""
    with open(path, "rb") as f:
        try:
            return tomllib.load(f)
        except tomllib.TOMLDecodeError as exc:
            raise ConfigurationError(f"{path}: not valid TOML: {exc}") from exc


def load_toml(path: str | Path, *, token: str | None = None) -> TransferConfig:
    """Read a TOML configuration file (every table and key maps onto `TransferConfig`).

    Args:
        path: the file.
        token: the control plane's token, over the file's `[control] token` (keep the token
            out of files others may read: pass it from the environment or a secret store).

    Raises:
        ConfigurationError: not TOML, an unknown table or key, or a bad value (one line naming
            it).
    """
    data = read_toml(path)
    if token is not None:
        data = merge(data, {"control": {"token": token}})
    return config_from_mapping(data)


def merge(base: Mapping[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    """Deep-merge two nested mappings (CLI flags over a TOML file)."""
    out: dict[str, Any] = dict(base)
    for k, v in override.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), Mapping):
            out[k] = merge(out[k], v)
        else:
            out[k] = v
    return out
