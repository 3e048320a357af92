"""Which UCX build the ucx backend loads (`library`), what its UCX_TLS may name, and one build
per process. Pure functions on synthetic builds and resources first; then the loaded build of
this process, and one subprocess for the one-build rule (a process cannot unload a build).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.markers import requires_module
from weight_transfer.backends import availability
from weight_transfer.backends.base import ConfigurationError, TransportConfig
from weight_transfer.backends.ucx_native import _builds, _libucp, _tls, _uct
from weight_transfer.backends.ucx_native._uct import Resource
from weight_transfer.errors import TransportUnavailableError

# -- builds: files, resolution ----------------------------------------------------------------


def _fake_build(folder: Path, *, hashed: bool = False, modules: tuple[str, ...] = ()) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for stem in ("ucm", "ucs", "uct", "ucp", "ucs_signal"):
        name = f"lib{stem}-1a2b3c4d.so.0.0.0" if hashed else f"lib{stem}.so.0"
        (folder / name).write_bytes(b"")
    (folder / "ucx").mkdir(exist_ok=True)
    for module in modules:
        (folder / "ucx" / f"libuct_{module}.so.0.0.0").write_bytes(b"")
    return folder


def test_library_files_plain_and_hashed_names(tmp_path: Path) -> None:
    plain = _uct.library_files(str(_fake_build(tmp_path / "plain")))
    assert Path(plain.ucp).name == "libucp.so.0" and Path(plain.ucs).name == "libucs.so.0"
    hashed = _uct.library_files(str(_fake_build(tmp_path / "hashed", hashed=True)))
    assert Path(hashed.ucs).name == "libucs-1a2b3c4d.so.0.0.0"  # never libucs_signal
    assert hashed.module_dir == str(tmp_path / "hashed" / "ucx")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="libucm"):
        _uct.library_files(str(tmp_path / "empty"))


def _fake_finders(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, **modules: tuple[str, ...] | None
) -> None:
    for name in ("wheel", "system", "nixl"):
        mods = modules.get(name)
        build = (
            None
            if mods is None
            else _builds._build(name, str(_fake_build(tmp_path / name, modules=mods)))
        )
        monkeypatch.setitem(_builds._FINDERS, name, lambda b=build: b)


def test_auto_takes_a_verbs_build_only_where_there_is_rdma(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _fake_finders(
        monkeypatch,
        tmp_path,
        wheel=("cma", "cuda"),
        system=("cma", "ib", "rdmacm"),
        nixl=("cma", "cuda", "ib", "ib_mlx5", "ib_efa"),
    )
    assert _builds.resolve("auto", rdma=False).library == "wheel"
    assert _builds.resolve("auto", rdma=True).library == "system"
    # GPU memory over RDMA: the verbs build that also has CUDA comes first.
    assert _builds.resolve("auto", rdma=True, cuda=True).library == "nixl"
    nixl = _builds.resolve("nixl", rdma=False)
    assert nixl.has_verbs_module and nixl.has_efa_module and nixl.has_cuda_module


def test_auto_without_a_verbs_build_falls_back_to_the_wheel(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _fake_finders(monkeypatch, tmp_path, wheel=("cma",), system=("cma",), nixl=None)
    assert _builds.resolve("auto", rdma=True).library == "wheel"
    _fake_finders(monkeypatch, tmp_path, wheel=None, system=None, nixl=None)
    with pytest.raises(TransportUnavailableError, match="libucx0.*nixl-cu13"):
        _builds.resolve("auto", rdma=False)


def test_named_build_missing_says_how_to_install(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _fake_finders(monkeypatch, tmp_path, wheel=None, system=None, nixl=None)
    with pytest.raises(
        TransportUnavailableError, match=r"library=system: .*apt-get install libucx0"
    ):
        _builds.resolve("system", rdma=False)
    with pytest.raises(TransportUnavailableError, match=r"library=nixl: .*pip install nixl-cu13"):
        _builds.resolve("nixl", rdma=False)


def test_a_folder_or_nothing(tmp_path: Path) -> None:
    build = _builds.resolve(str(_fake_build(tmp_path / "mine", modules=("ib",))), rdma=False)
    assert build.library == "path" and build.has_verbs_module
    (tmp_path / "nothing").mkdir()
    with pytest.raises(ConfigurationError, match="does not hold UCX's libraries"):
        _builds.resolve(str(tmp_path / "nothing"), rdma=False)
    with pytest.raises(ConfigurationError, match="is not a folder"):
        _builds.resolve(str(tmp_path / "absent"), rdma=False)
    with pytest.raises(ConfigurationError, match="auto, wheel, system, nixl"):
        _builds.resolve("sytem", rdma=False)


def test_the_builds_installed_here_are_found() -> None:
    """The three builds this project names, where they are installed (CI installs all)."""
    found = {name: _builds.find_build(name) for name in ("wheel", "system", "nixl")}
    for name, build in found.items():
        if build is None:
            continue
        assert os.path.isfile(build.libucp), name
        assert build.library == name
    if found["system"] is not None and Path("/usr/lib/x86_64-linux-gnu/libucp.so.0").exists():
        assert found["system"].has_verbs_module  # Debian's libucx0 ships libuct_ib
    if found["wheel"] is not None:
        assert not found["wheel"].has_verbs_module  # the reason issue 39 exists
    if found["nixl"] is not None:
        assert found["nixl"].has_verbs_module and found["nixl"].has_efa_module


# -- UCX_TLS: UCP's selection, and the refusals -------------------------------------------------


def _r(tl: str, device: str, kind: str = "net", component: str | None = None) -> Resource:
    comp = component or {"rc_verbs": "ib", "ud_verbs": "ib", "rc_mlx5": "ib"}.get(tl, tl)
    return Resource(component=comp, md=comp, tl=tl, device=device, device_type=kind)


WHEEL = [
    _r("self", "memory", "self"),
    _r("tcp", "eth0"),
    _r("tcp", "lo"),
    _r("sysv", "memory", "shm"),
    _r("posix", "memory", "shm"),
    _r("cma", "memory", "shm"),
]
VERBS = WHEEL + [_r("rc_verbs", "rxe0:1"), _r("ud_verbs", "rxe0:1")]
BUILD = "UCX 1.22.0 from library=wheel (/x/libucp.so)"


def _on(resources: list[Resource], **values: str) -> set[tuple[str, str, bool]]:
    return {(e.resource.tl, e.resource.device, e.aux) for e in _tls.enabled(resources, values)}


def test_parse_allow_lists() -> None:
    assert _tls.parse("all") == _tls.AllowList("all")
    assert _tls.parse("rc_verbs, ud_verbs") == _tls.AllowList("allow", ("rc_verbs", "ud_verbs"))
    assert _tls.parse("^tcp,cma") == _tls.AllowList("negate", ("tcp", "cma"))
    assert _tls.parse("tcp,all").mode == "all"


def test_enabled_follows_ucp_aliases_negation_and_devices() -> None:
    # rc: rc_verbs as a lane, ud_verbs for wireup only.
    assert _on(VERBS, TLS="rc") == {("rc_verbs", "rxe0:1", False), ("ud_verbs", "rxe0:1", True)}
    assert _on(VERBS, TLS="rc_verbs,ud_verbs") == {
        ("rc_verbs", "rxe0:1", False),
        ("ud_verbs", "rxe0:1", False),
    }
    assert _on(VERBS, TLS="ud") == {("ud_verbs", "rxe0:1", False)}
    assert {t for t, _, _ in _on(VERBS, TLS="ib")} == {"rc_verbs", "ud_verbs"}
    assert {t for t, _, _ in _on(VERBS, TLS="sm")} == {"sysv", "posix", "cma"}
    assert _on(VERBS, TLS="shm") == _on(VERBS, TLS="sm")
    assert {t for t, _, _ in _on(VERBS, TLS="^tcp,rc")} == {
        "self",
        "sysv",
        "posix",
        "cma",
    }  # as in UCP, leaving an alias out leaves out its auxiliary members too
    assert {t for t, _, _ in _on(VERBS, TLS="^ib")} == {"self", "tcp", "sysv", "posix", "cma"}
    assert _on(VERBS, TLS="tcp", NET_DEVICES="lo") == {("tcp", "lo", False)}
    assert _on(VERBS, TLS="rc_verbs:aux") == {("rc_verbs", "rxe0:1", True)}
    assert _on(VERBS, TLS="\\rc") == set()  # strict names never match an alias
    assert len(_on(VERBS, TLS="all", NET_DEVICES="rxe0:1")) == len(VERBS) - 2  # no tcp


def _check(
    resources: list[Resource], rdma: tuple[str, ...] = (), ok_tcp: bool = False, **values: str
) -> str | None:
    return _tls.check(
        resources, values, build=BUILD, rdma_devices=list(rdma), allow_tcp_only=ok_tcp
    )


def test_a_lane_the_build_lacks_is_refused_naming_lane_build_and_what_it_has() -> None:
    refusal = _check(WHEEL, TLS="rc_verbs,ud_verbs")
    assert refusal is not None
    assert "'rc_verbs' is not available from " + BUILD in refusal
    assert "self, tcp (eth0, lo), sysv, posix, cma" in refusal
    refusal = _check(WHEEL, TLS="rc,tcp")
    assert refusal is not None and "'rc' (alias of rc_mlx5, rc_verbs)" in refusal
    assert "'cuda'" in (_check(WHEEL, TLS="cuda,tcp") or "")
    assert "'self'" not in (_check(WHEEL, TLS="tcp,self,rc_verbs") or "'self'")


def test_a_lane_off_the_configured_devices_is_refused() -> None:
    refusal = _check(VERBS, TLS="rc_verbs,ud_verbs,tcp", NET_DEVICES="lo")
    assert refusal is not None
    assert "'rc_verbs' runs on rxe0:1, none of which UCX_NET_DEVICES=lo allows" in refusal


def test_rc_without_a_wireup_lane_is_refused_and_rc_alias_is_not() -> None:
    refusal = _check(VERBS, TLS="rc_verbs", NET_DEVICES="rxe0:1")
    assert refusal is not None and "UCX_TLS=rc_verbs,ud_verbs" in refusal
    assert _check(VERBS, TLS="rc_verbs,ud_verbs", NET_DEVICES="rxe0:1") is None
    assert _check(VERBS, TLS="rc", NET_DEVICES="rxe0:1") is None
    assert _check(VERBS, TLS="rc_verbs,ud_verbs,self") is None  # NIXL's: self as well
    assert "no lane for its wireup" in (_check(VERBS, TLS="rc_verbs,tcp") or "")  # tcp cannot


def test_tcp_only_between_hosts_is_refused_where_rdma_exists_unless_allowed() -> None:
    refusal = _check(WHEEL, rdma=("rxe0",), TLS="tcp")
    assert refusal is not None
    assert "RDMA devices (rxe0)" in refusal and "tcp (eth0) only" in refusal
    assert "allow_tcp_only=yes" in refusal
    assert "tcp (eth0) only" in (_check(WHEEL, rdma=("rxe0",)) or "")  # TLS=all
    assert _check(WHEEL, rdma=("rxe0",), ok_tcp=True, TLS="tcp") is None
    assert _check(WHEEL, rdma=("rxe0",), TLS="tcp", NET_DEVICES="lo") is None  # stays on host
    assert _check(WHEEL, TLS="tcp") is None  # no RDMA here: tcp is all there is
    assert _check(VERBS, rdma=("rxe0",), TLS="all") is None  # verbs lanes alongside tcp


def test_nothing_enabled_is_refused() -> None:
    assert "enables no transport" in (_check(WHEEL, TLS="^self,tcp,sm") or "")


def test_one_sided_is_what_the_lanes_do() -> None:
    def one_sided(resources: list[Resource], version: tuple[int, int, int], **values: str) -> bool:
        return _tls.is_one_sided(_tls.enabled(resources, values), values, version)

    assert one_sided(VERBS, (1, 13, 1), TLS="rc_verbs,ud_verbs")
    assert one_sided(WHEEL, (1, 22, 0), NET_DEVICES="lo", PROTO_ENABLE="y")  # cma
    assert not one_sided(WHEEL, (1, 13, 1), NET_DEVICES="lo", PROTO_ENABLE="n")
    assert not one_sided(WHEEL, (1, 13, 1), NET_DEVICES="lo", PROTO_ENABLE="y")
    assert not one_sided(WHEEL, (1, 22, 0), TLS="tcp", NET_DEVICES="lo", PROTO_ENABLE="y")
    assert not one_sided(WHEEL, (1, 22, 0), PROTO_ENABLE="y")  # eth0: tcp to other hosts
    assert _tls.needs_wireup_reply(_tls.enabled(VERBS, {"TLS": "rc"}))
    assert not _tls.needs_wireup_reply(_tls.enabled(VERBS, {"TLS": "ud,tcp"}))


# -- the build this process loaded ------------------------------------------------------------


def _process_lib() -> _libucp.LibUcp:
    loaded = _libucp.loaded()
    return loaded or _libucp.load(_builds.resolve("auto", rdma=bool(availability.rdma_devices())))


@requires_module("libucx")
def test_the_loaded_build_lists_its_transports() -> None:
    tls = {r.tl for r in _process_lib().resources()}
    assert {"self", "tcp", "cma"} <= tls


@requires_module("libucx")
def test_a_missing_lane_is_refused_by_the_transport_from_options_and_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from weight_transfer.backends.ucx import UcxTransport

    lib = _process_lib()
    if "rc_verbs" in {r.tl for r in lib.resources()}:
        pytest.skip(f"{lib.describe()} has rc_verbs here")
    with pytest.raises(ConfigurationError) as info:
        UcxTransport(TransportConfig(name="ucx", options=(("TLS", "rc_verbs,ud_verbs"),)))
    text = str(info.value)
    assert "'rc_verbs' is not available from " + lib.describe() in text and "tcp (" in text
    assert "\n" not in text
    monkeypatch.setenv("UCX_TLS", "rc,tcp")  # UCX reads its environment: so does the check
    with pytest.raises(ConfigurationError, match="UCX_TLS lane 'rc'"):
        UcxTransport(TransportConfig(name="ucx"))
    monkeypatch.setenv("UCX_TLS", "tcp")
    UcxTransport(TransportConfig(name="ucx")).close()


@requires_module("libucx")
def test_bad_allow_tcp_only_is_refused() -> None:
    from weight_transfer.backends.ucx import UcxTransport

    with pytest.raises(ConfigurationError, match="allow_tcp_only='maybe'"):
        UcxTransport(TransportConfig(name="ucx", options=(("allow_tcp_only", "maybe"),)))


_ONE_BUILD = """
import json, os, sys
from weight_transfer.backends.base import TransportConfig, create_transport
from weight_transfer.backends.ucx_native import UcxBuildConflictError
out = {}
def make(library, *options):
    return create_transport(TransportConfig(name="ucx", options=(("library", library),) + options))
def listening_ports():
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        link = os.readlink(f"/proc/self/fd/{fd}") if os.path.islink(f"/proc/self/fd/{fd}") else ""
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    ports = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in open(table).read().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A" and f[9] in inodes:
                ports.append(int(f[1].rsplit(":", 1)[1], 16))
    return ports
first = make(sys.argv[1], ("TLS", "tcp"), ("TCP_PORT_RANGE", "29871-29880"))
out["ports"] = listening_ports()
out["env_after"] = os.environ.get("UCX_TCP_PORT_RANGE")
out["first"] = first._worker.lib.describe()
out["again"] = make(sys.argv[1])._worker.lib.describe()
out["auto"] = make("auto")._worker.lib.describe()
try:
    make(sys.argv[2])
    out["second"] = "accepted"
except UcxBuildConflictError as exc:
    out["second"] = str(exc)
print(json.dumps(out))
"""


@pytest.mark.timeout(120)
@pytest.mark.skipif(
    _builds.find_build("wheel") is None or _builds.find_build("system") is None,
    reason="needs two UCX builds: the libucx wheel and the system's libucp (libucx0)",
)
def test_a_second_build_in_one_process_is_refused_in_one_line() -> None:
    """One subprocess: the system's UCX first (with a transport option it can take only from
    the environment), then the same build again, auto, and the wheel (refused)."""
    run = subprocess.run(
        [sys.executable, "-c", _ONE_BUILD, "system", "wheel"],
        capture_output=True,
        text=True,
        timeout=110,
        env={k: v for k, v in os.environ.items() if not k.startswith("UCX_")},
    )
    assert run.returncode == 0, run.stderr[-2000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["first"].startswith("UCX 1.") and "library=system" in out["first"]
    assert out["again"] == out["first"] == out["auto"]  # same build: fine; auto keeps it
    second = out["second"]
    assert "\n" not in second
    assert "library=wheel" in second and "refused" in second and out["first"] in second
    # A transport option (prefixed: TCP_PORT_RANGE) reaches UCX 1.13, which cannot take it
    # through ucp_config_modify, by the environment while UCX creates its transports only.
    assert out["ports"] and all(29871 <= p <= 29880 for p in out["ports"]), out["ports"]
    assert out["env_after"] is None
    assert "invalid configuration" not in run.stderr


# -- the script the doctor runs for builds it must not load -------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.skipif(
    shutil.which("ucx_info") is None or _builds.find_build("system") is None,
    reason="needs the system UCX and its ucx_info (ucx-utils)",
)
def test_uct_listing_matches_ucx_info_for_the_system_build() -> None:
    """The libuct binding lists what UCX's own `ucx_info -d` lists (transport, device)."""
    build = _builds.find_build("system")
    assert build is not None
    script = Path(_uct.__file__)
    run = subprocess.run(
        [sys.executable, str(script), build.files.folder],
        capture_output=True,
        text=True,
        timeout=50,
    )
    described = json.loads(run.stdout)
    assert "error" not in described, described
    ours = {(r["tl"], r["device"]) for r in described["resources"]}
    info = subprocess.run(["ucx_info", "-d"], capture_output=True, text=True, timeout=50).stdout
    theirs, tl = set(), None
    for line in info.splitlines():
        key, _, value = line.lstrip("# ").partition(":")
        if key == "Transport":
            tl = value.strip()
        elif key == "Device" and tl is not None:
            theirs.add((tl, value.strip()))
            tl = None
    assert ours == theirs
    version = subprocess.run(["ucx_info", "-v"], capture_output=True, text=True, timeout=50).stdout
    assert f"# Version {described['version']}" in version


RXE = _tls.RocePort(
    "rxe0",
    1,
    "Ethernet",
    ("fe80:0000:0000:0000:8c99:b5ff:feb2:0d27", "0000:0000:0000:0000:0000:ffff:0a63:0001"),
)


def _gid_refusal(
    version: tuple[int, int, int],
    option: str | None = None,
    env: str | None = None,
    **ports: _tls.RocePort,
) -> str | None:
    values = {"TLS": "rc_verbs,ud_verbs", "NET_DEVICES": "rxe0:1"}
    if option is not None:
        values["IB_GID_INDEX"] = option
    return _tls.ud_gid_refusal(
        _tls.enabled(VERBS, values),
        values,
        version=version,
        ports=ports or {"rxe0:1": RXE},
        gid_index=env,
        build="UCX 1.13.1 from library=system (/usr/lib/libucp.so.0)",
    )


def test_ud_before_1_19_on_soft_roce_needs_an_ipv6_gid() -> None:
    """UCX < 1.19 drops ud packets from IPv4 GIDs on non-Mellanox RoCE (its ucx_perftest
    aborts in the Soft-RoCE VM); refused with the index to set, unless an IPv6 GID is set."""
    refusal = _gid_refusal((1, 13, 1))
    assert refusal is not None
    assert "ud_verbs on rxe0:1 cannot work with UCX 1.13.1" in refusal
    assert "set IB_GID_INDEX=0 (an IPv6 GID of rxe0:1: fe80:" in refusal
    assert "IB_GID_INDEX=1 is not an IPv6 GID" in (_gid_refusal((1, 13, 1), option="1") or "")
    assert _gid_refusal((1, 13, 1), option="0") is None
    assert _gid_refusal((1, 13, 1), env="0") is None  # UCX reads the environment too
    assert _gid_refusal((1, 13, 1), option="1", env="0") is not None  # the option wins
    assert _gid_refusal((1, 19, 0)) is None and _gid_refusal((1, 23, 0)) is None
    mlx = _tls.RocePort("mlx5_0", 1, "Ethernet", RXE.gids)
    assert _gid_refusal((1, 13, 1), **{"rxe0:1": mlx}) is None  # Mellanox fills the CQE
    ib = _tls.RocePort("rxe0", 1, "InfiniBand", RXE.gids)
    assert _gid_refusal((1, 13, 1), **{"rxe0:1": ib}) is None
    v4_only = _tls.RocePort("rxe0", 1, "Ethernet", ("0" * 4 + ":0000" * 7, RXE.gids[1]))
    assert "has no IPv6 GID: use UCX 1.19 or later" in (
        _gid_refusal((1, 13, 1), **{"rxe0:1": v4_only}) or ""
    )
