"""Topology files (``servers/*.toml``): which processes a local cluster runs, and with what flags.

Format (TOML, read with :mod:`tomllib`)::

    description = "one prefill, one decode, one router"
    transport = "rdma"              # default data plane; `--transport` overrides it
    metrics = true                  # optional: every server serves Prometheus metrics on a
                                    # free port (`--metrics` on the command line does too)

    [engine]                        # engine flags shared by every prefill and decode
    model-size = "tiny"             # (and by the colocated reference the tests compare with)
    page-size = 16

    [env]                           # extra environment for every process (optional)
    UCX_TLS = "tcp,sm,self"

    [security]                      # optional (docs/security.md); the launcher's
    tls = "auto"                    # --tls/--auth-token override: "auto" = a throwaway CA
    auth-token = "auto"             # and one certificate per process (mTLS) / a random
                                    # token in the run directory; "off" (default) = none.
                                    # Or files every process (and the launcher) uses:
                                    # tls-cert, tls-key, tls-ca, auth-token-file (paths
                                    # relative to the topology file)

    [[process]]
    name = "prefill"                # unique; logs and GetStats are per name
    role = "prefill"                # bootstrap | prefill | decode | router | colocated | etcd | smg
    bootstrap = "bootstrap"         # prefill only: a bootstrap process's name; omitted = embedded
    args = { dp-size = 2, load-balance = "round_robin" }   # extra flags, --key value

    [[process]]
    name = "router"
    role = "router"
    prefill = ["prefill"]           # router and smg only: the prefill and decode processes it routes to
    decode = ["decode"]

Across hosts (see docs/multihost.md): a ``[network]`` table turns on hosts made as network
namespaces, ``host = "h2"`` places a process on one, and a process of role ``etcd`` runs a
real etcd; then every server registers there (``--discovery``) and a router without
``prefill``/``decode`` lists routes to whatever is registered::

    [network]
    subnet = "10.77.0.0/24"         # private /24; host i of the sorted host names gets .i

    [[process]]
    name = "etcd"
    role = "etcd"
    host = "h1"

A ``role = "smg"`` process puts SGLang's model gateway beside the router, in front of the
same prefills and decodes (:mod:`pdgrpc.cluster.smg`).

Each ``args`` (and ``[engine]``) entry becomes ``--key value``; ``true`` becomes a bare
``--key``, ``false`` is left out, a list repeats the flag. The launcher adds ``--host``,
``--port`` and, for prefill and decode, ``--transport`` itself.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any, Mapping

from pdgrpc.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10 needs the backport (pyproject: tomli; python_version < "3.11")
    import tomli as tomllib

__all__ = ["ROLES", "ProcessSpec", "Topology", "flags", "load_topology"]

ROLES = ("bootstrap", "prefill", "decode", "router", "colocated", "etcd", "smg")
SECURITY_MODES = ("off", "auto")  # [security] tls / auth-token, and the launcher's --tls / --auth-token
_SECURITY_FILES = ("tls-cert", "tls-key", "tls-ca", "auth-token-file")  # [security] keys naming files
FRONT_DOORS = ("router", "colocated")  # what clients call: GenerateService
TRANSPORTS = ("rdma", "tcp", "fake")

Scalar = str | int | float | bool


@dataclasses.dataclass(frozen=True)
class ProcessSpec:
    name: str
    role: str
    args: Mapping[str, Scalar | list[Scalar]] = dataclasses.field(default_factory=dict)
    bootstrap: str | None = None  # prefill: name of a separate bootstrap process
    prefill: tuple[str, ...] = ()  # router, smg: prefill process names
    decode: tuple[str, ...] = ()  # router, smg: decode process names
    host: str = ""  # with [network]: the host (network namespace) it runs on
    # The launcher starts it again when it exits while the cluster runs (restart = false:
    # its exit stops the cluster instead).
    restart: bool = True

    @property
    def module(self) -> str:
        return f"pdgrpc.{self.role}"


@dataclasses.dataclass(frozen=True)
class Topology:
    name: str
    description: str
    transport: str
    engine: Mapping[str, Scalar]
    env: Mapping[str, str]
    processes: tuple[ProcessSpec, ...]
    path: Path | None = None
    metrics: bool = False  # give every server a --metrics-port
    tls: str | None = None  # [security] tls: "auto" or "off"; None: the topology does not say
    auth_token: str = "off"  # [security] auth-token: "auto" or "off"
    security_files: Mapping[str, Path] = dataclasses.field(default_factory=dict)  # [security] tls-cert, ... -> file
    subnet: str = ""  # with [network]: the hosts' private /24; "" = everything on 127.0.0.1

    @property
    def hosts(self) -> tuple[str, ...]:
        """The hosts the processes are placed on, sorted (empty without [network])."""
        return tuple(sorted({p.host for p in self.processes if p.host}))

    @property
    def etcd(self) -> ProcessSpec | None:
        return next((p for p in self.processes if p.role == "etcd"), None)

    def process(self, name: str) -> ProcessSpec:
        for p in self.processes:
            if p.name == name:
                return p
        raise KeyError(f"topology {self.name!r} has no process {name!r}")

    def by_role(self, role: str) -> list[ProcessSpec]:
        return [p for p in self.processes if p.role == role]

    @property
    def router(self) -> ProcessSpec:
        """The front door: the router, or the colocated server of a colocated topology."""
        return next(p for p in self.processes if p.role in FRONT_DOORS)


def flags(values: Mapping[str, Any]) -> list[str]:
    """``{"dp-size": 2, "verbose": True, "x": [1, 2]}`` -> ``["--dp-size", "2", "--verbose", "--x", "1", "--x", "2"]``."""
    out: list[str] = []
    for key, value in values.items():
        items = value if isinstance(value, list) else [value]
        for v in items:
            if v is True:
                out.append(f"--{key}")
            elif v is False:
                continue
            else:
                out += [f"--{key}", str(v)]
    return out


def _fail(where: str, msg: str) -> ConfigError:
    return ConfigError(f"{where}: {msg}")


def _str_list(where: str, value: Any, field: str) -> tuple[str, ...]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise _fail(where, f"{field} must be a process name or a list of them, got {value!r}")
    return tuple(value)


def _check_args(where: str, args: Any) -> dict[str, Any]:
    if not isinstance(args, dict):
        raise _fail(where, f"args must be a table of flag = value, got {args!r}")
    for k, v in args.items():
        items = v if isinstance(v, list) else [v]
        if not all(isinstance(i, (str, int, float, bool)) for i in items):
            raise _fail(where, f"flag {k!r} has a value that is not a string, number or boolean: {v!r}")
        if k in ("host", "port", "transport", "metrics-port", "metrics-host", "tls-cert", "tls-key", "tls-ca", "auth-token-file"):
            raise _fail(where, f"flag --{k} is set by the launcher; remove it from args")
    return dict(args)


def parse_topology(data: Mapping[str, Any], name: str, path: Path | None = None) -> Topology:
    """Validate a parsed topology table; raises :class:`ConfigError` naming the bad field."""
    where = str(path or name)
    known = {"description", "transport", "engine", "env", "process", "metrics", "network", "security"}
    unknown = set(data) - known
    if unknown:
        raise _fail(where, f"unknown top-level keys {sorted(unknown)} (expected {sorted(known)})")
    transport = data.get("transport", "rdma")
    if transport not in TRANSPORTS:
        raise _fail(where, f"transport must be one of {TRANSPORTS}, got {transport!r}")
    metrics = data.get("metrics", False)
    if not isinstance(metrics, bool):
        raise _fail(where, f"metrics must be true or false, got {metrics!r}")
    engine = _check_args(f"{where} [engine]", data.get("engine", {}))
    security = data.get("security", {})
    if not isinstance(security, dict) or set(security) - {"tls", "auth-token", *_SECURITY_FILES}:
        raise _fail(where, f"[security] takes tls, auth-token, {', '.join(_SECURITY_FILES)}; got {security!r}")
    files: dict[str, Path] = {}
    for key, value in security.items():
        if key in _SECURITY_FILES:
            if not isinstance(value, str) or not value:
                raise _fail(where, f"[security] {key} must be a file path, got {value!r}")
            files[key] = (path.parent if path is not None else Path.cwd()) / value
        elif value not in SECURITY_MODES:
            raise _fail(where, f"[security] {key} must be one of {SECURITY_MODES}, got {value!r}")
    if ("tls-cert" in files) != ("tls-key" in files):
        raise _fail(where, "[security] tls-cert and tls-key go together")
    if security.get("tls") == "auto" and {"tls-cert", "tls-ca"} & set(files):
        raise _fail(where, "[security] tls = \"auto\" makes its own certificates: drop tls-cert/tls-key/tls-ca, or tls")
    if security.get("auth-token") == "auto" and "auth-token-file" in files:
        raise _fail(where, "[security] auth-token = \"auto\" makes its own token: drop auth-token-file, or auth-token")
    env = data.get("env", {})
    if not isinstance(env, dict) or not all(isinstance(v, str) for v in env.values()):
        raise _fail(where, "[env] must be a table of NAME = \"value\" strings")
    subnet = _network(where, data.get("network"))
    raw = data.get("process", [])
    if not isinstance(raw, list) or not raw:
        raise _fail(where, "needs at least one [[process]]")
    procs: list[ProcessSpec] = []
    for i, p in enumerate(raw):
        pw = f"{where} process[{i}]"
        if not isinstance(p, dict):
            raise _fail(pw, "must be a table")
        extra = set(p) - {"name", "role", "args", "bootstrap", "prefill", "decode", "host", "restart"}
        if extra:
            raise _fail(pw, f"unknown keys {sorted(extra)}")
        pname, role = p.get("name"), p.get("role")
        if not isinstance(pname, str) or not pname or not pname.replace("-", "").replace("_", "").isalnum():
            raise _fail(pw, f"name must be a non-empty name of letters, digits, '-' and '_', got {pname!r}")
        pw = f"{where} process {pname!r}"
        if role not in ROLES:
            raise _fail(pw, f"role must be one of {ROLES}, got {role!r}")
        bootstrap = p.get("bootstrap")
        if bootstrap is not None and (role != "prefill" or not isinstance(bootstrap, str)):
            raise _fail(pw, "bootstrap = \"<bootstrap process name>\" is only for prefill processes")
        if role == "etcd" and p.get("args"):
            raise _fail(pw, "an etcd process takes no args (the launcher sets its ports and data dir)")
        if role not in ("router", "smg") and ("prefill" in p or "decode" in p):
            raise _fail(pw, "prefill/decode lists are only for router and smg processes")
        restart = p.get("restart", True)
        if not isinstance(restart, bool):
            raise _fail(pw, f"restart must be true or false, got {restart!r}")
        procs.append(
            ProcessSpec(
                name=pname,
                role=role,
                args=_check_args(pw, p.get("args", {})),
                bootstrap=bootstrap,
                prefill=_str_list(pw, p.get("prefill", []), "prefill"),
                decode=_str_list(pw, p.get("decode", []), "decode"),
                host=_host(pw, p.get("host", ""), subnet),
                restart=restart,
            )
        )
    roles = {p.name: p.role for p in procs}
    if len(roles) != len(procs):
        twice = sorted({p.name for p in procs if sum(q.name == p.name for q in procs) > 1})
        raise _fail(where, f"process names must be unique; more than one [[process]] is named {', '.join(map(repr, twice))}")
    for p in procs:
        pw = f"{where} process {p.name!r}"
        if p.bootstrap is not None and roles.get(p.bootstrap) != "bootstrap":
            raise _fail(pw, f"bootstrap = {p.bootstrap!r} is not a bootstrap process of this topology")
        if p.role == "smg" and (not p.prefill or not p.decode):
            raise _fail(pw, "a smg needs prefill = [...] and decode = [...]")
        if p.role in ("router", "smg"):
            if p.role == "router" and (not p.prefill or not p.decode) and not any(q.role == "etcd" for q in procs):
                raise _fail(pw, "a router needs prefill = [...] and decode = [...] (or an etcd process to discover them)")
            for ref, want in [(r, "prefill") for r in p.prefill] + [(r, "decode") for r in p.decode]:
                if roles.get(ref) != want:
                    raise _fail(pw, f"{ref!r} is not a {want} process of this topology")
    if subnet and any(not p.host for p in procs):
        raise _fail(where, "with [network], every process needs host = \"<host name>\"")
    if len([p for p in procs if p.role == "etcd"]) > 1:
        raise _fail(where, "at most one etcd process")
    if len([p for p in procs if p.role == "smg"]) > 1:
        raise _fail(where, "at most one smg process")
    if len([p for p in procs if p.role in FRONT_DOORS]) != 1:
        raise _fail(where, "needs exactly one router (or colocated) process: the cluster's front door")
    return Topology(
        name=name,
        description=str(data.get("description", "")),
        transport=transport,
        engine=engine,
        env=dict(env),
        processes=tuple(procs),
        path=path,
        metrics=metrics,
        subnet=subnet,
        tls=security.get("tls"),
        auth_token=security.get("auth-token", "off"),
        security_files=files,
    )


def _network(where: str, table: Any) -> str:
    if table is None:
        return ""
    if not isinstance(table, dict) or set(table) - {"subnet"}:
        raise _fail(where, f"[network] takes subnet = \"10.x.y.0/24\" only, got {table!r}")
    subnet = table.get("subnet", "10.77.0.0/24")
    if not isinstance(subnet, str):
        raise _fail(where, f"[network] subnet must be a string, got {subnet!r}")
    return subnet


def _host(where: str, host: Any, subnet: str) -> str:
    if host == "":
        return ""
    if not subnet:
        raise _fail(where, "host = ... needs a [network] table (hosts are network namespaces)")
    if not isinstance(host, str) or not host.isalnum() or not host[:1].isalpha() or len(host) > 8 or host != host.lower():
        raise _fail(where, f"host must be 1-8 lower-case letters and digits starting with a letter, got {host!r}")
    return host


def servers_dir() -> Path:
    """The repository's ``servers/`` directory (topology files)."""
    return Path(__file__).resolve().parents[2] / "servers"


def load_topology(spec: str | Path) -> Topology:
    """Load a topology from a path, or by name from ``servers/`` (``"1p1d"``)."""
    path = Path(spec)
    if not path.exists() and path.suffix == "" and (servers_dir() / f"{spec}.toml").exists():
        path = servers_dir() / f"{spec}.toml"
    if not path.exists():
        raise ConfigError(f"topology {str(spec)!r}: no such file (topologies live in {servers_dir()})")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:  # a directory, an unreadable or binary file: one line, not a traceback
        why = exc.strerror if isinstance(exc, OSError) else f"not UTF-8 text ({exc.reason} at byte {exc.start})"
        raise ConfigError(f"topology {str(spec)!r}: cannot read {path}: {why}") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    return parse_topology(data, path.stem, path)
