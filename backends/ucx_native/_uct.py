"""What a UCX build can carry: its libraries in a folder, loaded, and its transports listed
through libuct (ctypes), as `ucx_info -d` lists them.

A build is a folder holding `libucp`, `libuct`, `libucs` and `libucm` (plain names such as
`libucp.so.0`, or the hashed names a wheel's `.libs` folder uses, `libucp-b39b3ed9.so.0.0.0`)
with its transport modules in `ucx/` beside them. `library_files` finds the four files,
`open_build` loads them from that folder (dependencies first, each by its full path, so a
library's `DT_NEEDED` resolves to the copy already loaded from the same folder, never to another
build's), and `list_resources` asks libuct for every component, memory domain and transport
resource: `uct_query_components`, `uct_component_query`, `uct_md_config_read`, `uct_md_open`,
`uct_md_query_tl_resources`. Those functions and the two structs they fill
(`uct_component_attr_t`, `uct_tl_resource_desc_t`) are the same in UCX 1.13 and 1.22
(`src/uct/api/uct.h`); `tests/unit/test_ucx_binding.py` pins their layouts.

Only stdlib imports, and runnable as a script: `python _uct.py FOLDER` prints the build's
version and transports as JSON. `weight-transfer doctor` runs it that way for builds this
process must not load (one UCX build per process: `_libucp.load`).
"""

from __future__ import annotations

import ctypes
import dataclasses
import glob
import json
import os
import sys
from ctypes import POINTER, Structure, c_char, c_char_p, c_int, c_uint, c_uint8, c_uint64, c_void_p
from typing import Any

__all__ = [
    "BuildFiles",
    "Resource",
    "build_version",
    "library_files",
    "list_resources",
    "module_names",
    "open_build",
    "rdma_ports",
]

UCT_COMPONENT_NAME_MAX = 16
UCT_MD_NAME_MAX = 16
UCT_TL_NAME_MAX = 10
UCT_DEVICE_NAME_MAX = 32

UCT_COMPONENT_ATTR_FIELD_NAME = 1 << 0
UCT_COMPONENT_ATTR_FIELD_MD_RESOURCE_COUNT = 1 << 1
UCT_COMPONENT_ATTR_FIELD_MD_RESOURCES = 1 << 2
UCT_COMPONENT_ATTR_FIELD_FLAGS = 1 << 3
UCT_COMPONENT_FLAG_CM = 1 << 0

DEVICE_TYPES = ("net", "shm", "acc", "self")
"""`uct_device_type_t` by value: UCT_DEVICE_TYPE_NET, _SHM, _ACC, _SELF (1.13 and 1.22)."""


class uct_component_attr_t(Structure):
    """`struct uct_component_attr` (uct.h)."""

    _fields_ = [
        ("field_mask", c_uint64),
        ("name", c_char * UCT_COMPONENT_NAME_MAX),
        ("md_resource_count", c_uint),
        ("md_resources", c_void_p),
        ("flags", c_uint64),
    ]


class uct_tl_resource_desc_t(Structure):
    """`struct uct_tl_resource_desc` (uct.h)."""

    _fields_ = [
        ("tl_name", c_char * UCT_TL_NAME_MAX),
        ("dev_name", c_char * UCT_DEVICE_NAME_MAX),
        ("dev_type", c_int),
        ("sys_device", c_uint8),
    ]


STRUCTS: dict[str, type[Structure]] = {
    "uct_component_attr_t": uct_component_attr_t,
    "uct_tl_resource_desc_t": uct_tl_resource_desc_t,
}
"""Every libuct struct bound here, by its C name (the layout test walks this table)."""

_LIBRARY_ORDER = ("ucm", "ucs", "uct", "ucp")
"""Load order: each library needs the ones before it (libucm calls back into libucs, so it is
opened lazily bound)."""


@dataclasses.dataclass(frozen=True, slots=True)
class BuildFiles:
    """The four libraries of one UCX build, by their real paths."""

    ucm: str
    ucs: str
    uct: str
    ucp: str

    @property
    def folder(self) -> str:
        """The folder holding them."""
        return os.path.dirname(self.ucp)

    @property
    def module_dir(self) -> str:
        """Where this build's libucs looks for transport modules (`<its folder>/ucx`)."""
        return os.path.join(os.path.dirname(self.ucs), "ucx")


@dataclasses.dataclass(frozen=True, slots=True)
class Resource:
    """One transport resource of a build: a transport on a device (`ucx_info -d` lists these)."""

    component: str
    md: str
    tl: str
    """Transport name, as `UCX_TLS` names it (`rc_verbs`, `tcp`, `cma`, ...)."""
    device: str
    """Device name, as `UCX_*_DEVICES` names it (`rxe0:1`, `eth0`, `memory`)."""
    device_type: str
    """One of `DEVICE_TYPES`."""


def _pick(folder: str, stem: str) -> str | None:
    """The real path of `lib<stem>` in `folder`: `lib<stem>.so*` or a wheel's hashed
    `lib<stem>-<hash>.so*` (never `libucs_signal`, never a static archive)."""
    found = sorted(
        os.path.realpath(p)
        for pattern in (f"lib{stem}.so*", f"lib{stem}-*.so*")
        for p in glob.glob(os.path.join(folder, pattern))
        if os.path.isfile(p)
    )
    return found[0] if found else None


def library_files(folder: str) -> BuildFiles:
    """The UCX libraries in `folder`.

    Raises:
        FileNotFoundError: one of libucp, libuct, libucs, libucm is not there (named).
    """
    paths: dict[str, str] = {}
    for stem in _LIBRARY_ORDER:
        path = _pick(folder, stem)
        if path is None:
            raise FileNotFoundError(f"no lib{stem}.so* in {folder}")
        paths[stem] = path
    return BuildFiles(**paths)


def module_names(files: BuildFiles) -> list[str]:
    """The transport modules this build ships (`ib`, `cma`, `cuda`, ...), from file names."""
    names = set()
    for path in glob.glob(os.path.join(files.module_dir, "libuct_*.so*")):
        base = os.path.basename(path)[len("libuct_") :]
        names.add(base.split(".so")[0])
    return sorted(names)


def open_build(files: BuildFiles) -> dict[str, ctypes.CDLL]:
    """Load the build's libraries (RTLD_LOCAL, dependencies first), by full path.

    Raises:
        OSError: the dynamic loader refused one (its message names it).
    """
    libs: dict[str, ctypes.CDLL] = {}
    for stem in _LIBRARY_ORDER:
        mode = ctypes.RTLD_LOCAL | (os.RTLD_LAZY if stem == "ucm" else 0)
        libs[stem] = ctypes.CDLL(getattr(files, stem), mode)
    return libs


def build_version(ucp: ctypes.CDLL) -> tuple[int, int, int]:
    """(major, minor, release) of a loaded libucp (`ucp_get_version`)."""
    fn = ucp.ucp_get_version
    fn.restype = None
    fn.argtypes = [POINTER(c_uint)] * 3
    major, minor, release = c_uint(), c_uint(), c_uint()
    fn(ctypes.byref(major), ctypes.byref(minor), ctypes.byref(release))
    return major.value, minor.value, release.value


def _bind(uct: ctypes.CDLL) -> dict[str, Any]:
    specs: dict[str, tuple[Any, list[Any]]] = {
        "uct_query_components": (c_int, [POINTER(POINTER(c_void_p)), POINTER(c_uint)]),
        "uct_release_component_list": (None, [POINTER(c_void_p)]),
        "uct_component_query": (c_int, [c_void_p, POINTER(uct_component_attr_t)]),
        "uct_md_config_read": (c_int, [c_void_p, c_char_p, c_char_p, POINTER(c_void_p)]),
        "uct_config_release": (None, [c_void_p]),
        "uct_md_open": (c_int, [c_void_p, c_char_p, c_void_p, POINTER(c_void_p)]),
        "uct_md_close": (None, [c_void_p]),
        "uct_md_query_tl_resources": (
            c_int,
            [c_void_p, POINTER(POINTER(uct_tl_resource_desc_t)), POINTER(c_uint)],
        ),
        "uct_release_tl_resource_list": (None, [POINTER(uct_tl_resource_desc_t)]),
    }
    fns: dict[str, Any] = {}
    for name, (restype, argtypes) in specs.items():
        fn = getattr(uct, name)
        fn.restype = restype
        fn.argtypes = argtypes
        fns[name] = fn
    return fns


def list_resources(uct: ctypes.CDLL) -> tuple[list[str], list[Resource]]:
    """(component names, transport resources) of a loaded libuct, in libuct's order.

    A memory domain that does not open (a device that went away) is skipped: it offers no
    transport. Connection-manager components (`rdmacm`, `tcp`'s sockcm side) have no
    transports of their own; they are listed among the components only.

    Raises:
        OSError: `uct_query_components` failed.
    """
    f = _bind(uct)
    components = POINTER(c_void_p)()
    count = c_uint()
    status = f["uct_query_components"](ctypes.byref(components), ctypes.byref(count))
    if status != 0:
        raise OSError(f"uct_query_components failed (ucs_status {status})")
    names: list[str] = []
    resources: list[Resource] = []
    try:
        for i in range(count.value):
            component = components[i]
            attr = uct_component_attr_t()
            attr.field_mask = (
                UCT_COMPONENT_ATTR_FIELD_NAME
                | UCT_COMPONENT_ATTR_FIELD_MD_RESOURCE_COUNT
                | UCT_COMPONENT_ATTR_FIELD_FLAGS
            )
            if f["uct_component_query"](component, ctypes.byref(attr)) != 0:
                continue
            name = attr.name.decode(errors="replace")
            names.append(name)
            num_mds = attr.md_resource_count
            if num_mds == 0:
                continue
            mds = (c_char * UCT_MD_NAME_MAX * num_mds)()
            attr.field_mask = UCT_COMPONENT_ATTR_FIELD_MD_RESOURCES
            attr.md_resources = ctypes.cast(mds, c_void_p)
            if f["uct_component_query"](component, ctypes.byref(attr)) != 0:
                continue
            for j in range(num_mds):
                md_name = bytes(mds[j]).split(b"\0")[0]
                resources.extend(_md_resources(f, component, name, md_name))
    finally:
        f["uct_release_component_list"](components)
    return names, resources


def _md_resources(f: dict[str, Any], component: int, name: str, md_name: bytes) -> list[Resource]:
    config = c_void_p()
    if f["uct_md_config_read"](component, None, None, ctypes.byref(config)) != 0:
        return []
    md = c_void_p()
    try:
        status = f["uct_md_open"](component, md_name, config, ctypes.byref(md))
    finally:
        f["uct_config_release"](config)
    if status != 0:
        return []
    out: list[Resource] = []
    try:
        descs = POINTER(uct_tl_resource_desc_t)()
        num = c_uint()
        if f["uct_md_query_tl_resources"](md, ctypes.byref(descs), ctypes.byref(num)) != 0:
            return []
        try:
            for k in range(num.value):
                d = descs[k]
                kind = d.dev_type
                out.append(
                    Resource(
                        component=name,
                        md=md_name.decode(errors="replace"),
                        tl=d.tl_name.decode(errors="replace"),
                        device=d.dev_name.decode(errors="replace"),
                        device_type=DEVICE_TYPES[kind] if 0 <= kind < len(DEVICE_TYPES) else "?",
                    )
                )
        finally:
            f["uct_release_tl_resource_list"](descs)
    finally:
        f["uct_md_close"](md)
    return out


RDMA_SYSFS = "/sys/class/infiniband"


def rdma_ports(resources: list[Resource]) -> list[dict[str, Any]]:
    """The RDMA device ports a build's transports run on (`rxe0:1`), with the kernel's port
    state (`/sys/class/infiniband/<dev>/ports/<n>/state`, e.g. "ACTIVE")."""
    seen: dict[str, dict[str, Any]] = {}
    for r in resources:
        device, _, port = r.device.partition(":")
        if r.device_type != "net" or not port.isdigit():
            continue
        if not os.path.isdir(os.path.join(RDMA_SYSFS, device)):
            continue
        entry = seen.setdefault(
            r.device, {"device": device, "port": int(port), "state": None, "transports": []}
        )
        if entry["state"] is None:
            entry["state"] = _port_state(device, int(port))
        if r.tl not in entry["transports"]:
            entry["transports"].append(r.tl)
    return list(seen.values())


def _port_state(device: str, port: int) -> str | None:
    try:
        with open(os.path.join(RDMA_SYSFS, device, "ports", str(port), "state")) as fh:
            text = fh.read().strip()  # "4: ACTIVE"
    except OSError:
        return None
    return text.partition(":")[2].strip() or text


def describe(folder: str) -> dict[str, Any]:
    """Load the build in `folder` and describe it (what the script prints). Never raises."""
    out: dict[str, Any] = {"folder": folder}
    try:
        files = library_files(folder)
        out["libucp"] = files.ucp
        out["modules"] = module_names(files)
        libs = open_build(files)
        out["version"] = ".".join(map(str, build_version(libs["ucp"])))
        components, resources = list_resources(libs["uct"])
        out["components"] = components
        out["resources"] = [dataclasses.asdict(r) for r in resources]
        out["rdma_ports"] = rdma_ports(resources)
    except (OSError, AttributeError) as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    return out


if __name__ == "__main__":  # pragma: no cover - run by the doctor in a child process
    print(json.dumps(describe(sys.argv[1])))
