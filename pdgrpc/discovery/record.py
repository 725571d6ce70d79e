"""What one instance writes to etcd, and the router's view of all of them (pure: no I/O).

Key layout::

    /pdgrpc/<cluster name>/<role>/<instance id>   ->   JSON record (one per instance)

The value (:class:`Instance`) holds the instance's gRPC address, its bootstrap address
(prefill only), transport, parallel sizes, compatibility hash and generation. The key is
attached to the instance's lease: when the lease ends (clean shutdown revokes it, a dead
process stops renewing it) etcd deletes the key and every watcher sees the delete.

:class:`MembershipView` applies etcd's puts and deletes and answers "which prefills and
decodes may take a request now". It skips, and logs once per distinct bad value:

* a value that is not a record of this format (malformed JSON, a foreign writer, a key
  whose role or instance id disagrees with the record);
* an instance whose compatibility hash or transport differs from the cluster's
  reference, which is the oldest live instance's (lowest etcd create revision): prefill
  and decode exchange KV only when both agree.

Given an ``opener`` (under mTLS: :class:`pdgrpc.discovery.signing.RecordVerifier`), it
takes only records signed by a certificate of the cluster's CA that names the record's
role; an unsigned or wrongly signed value is ignored like any bad value. Every ignored
value is counted (:attr:`MembershipView.ignored`); the first few are logged, then one line
per thousand, so a flood of junk keys costs a parse and a count each.

A signed record names its signer's key. Given ``prove=True`` (a router under mTLS), its
instance is listed only once the server at its address has shown that key (:meth:`MembershipView.prove`, fed by the watcher's
:class:`pdgrpc.discovery.identity.DialIdentity`): a record pointing at another
instance's address is never routed to, and each such refusal is counted
(:attr:`MembershipView.identity_mismatches`) and logged once. The router's channels to a
proven address then expect the signer's key name (:meth:`MembershipView.server_name`) in
every TLS handshake, so a server that later answers there in the signer's place (its
port taken while its lease lives) is refused too.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import re
from typing import Callable, Iterable, Mapping

from pdgrpc.errors import ConfigError

__all__ = [
    "FORMAT",
    "ROLES",
    "Instance",
    "MembershipView",
    "check_name",
    "instance_key",
    "cluster_prefix",
]

log = logging.getLogger("pdgrpc.discovery")

FORMAT = 1  # the record's format version: a record of another format is skipped
ROLES = ("prefill", "decode", "bootstrap")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def check_name(value: str, what: str) -> str:
    """``value`` when it is a name fit for an etcd key segment, else ConfigError naming ``what``."""
    if not _NAME.match(value):
        raise ConfigError(
            f"{what} {value!r}: use 1-128 letters, digits, '.', '_' or '-', starting with a letter or digit"
        )
    return value


def cluster_prefix(cluster: str) -> str:
    """``/pdgrpc/<cluster>/``: the prefix a router watches."""
    return f"/pdgrpc/{check_name(cluster, '--cluster-name')}/"


def instance_key(cluster: str, role: str, instance_id: str) -> str:
    if role not in ROLES:
        raise ConfigError(f"role must be one of {ROLES}, got {role!r}")
    return f"{cluster_prefix(cluster)}{role}/{check_name(instance_id, '--instance-id')}"


@dataclasses.dataclass(frozen=True)
class Instance:
    """One registered server instance (the JSON value under its key)."""

    role: str
    instance_id: str
    address: str  # HOST:PORT of its gRPC server (PrefillService / DecodeService / BootstrapService)
    transport: str = ""  # data-plane backend name; "" for a bootstrap
    bootstrap: str = ""  # prefill: HOST:PORT of its BootstrapService (its own address when embedded)
    dp_size: int = 1
    tp_size: int = 1
    compat_hash: str = ""  # hex digest of model, KV layout and protocol version; "" for a bootstrap
    generation: int = 0  # differs on every start of the instance (microseconds since the epoch)

    def to_json(self) -> bytes:
        doc = {"format": FORMAT, **dataclasses.asdict(self)}
        return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes) -> "Instance":
        """Parse and validate a record; ConfigError saying what is wrong."""
        try:
            doc = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ConfigError(f"not JSON: {exc}") from None
        if not isinstance(doc, dict):
            raise ConfigError("not a JSON object")
        if doc.get("format") != FORMAT:
            raise ConfigError(f"format {doc.get('format')!r} is not {FORMAT}")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = set(doc) - set(fields) - {"format"}
        if unknown:
            raise ConfigError(f"unknown fields {sorted(unknown)}")
        values: dict[str, object] = {}
        for name, f in fields.items():
            if name not in doc:
                if f.default is dataclasses.MISSING:
                    raise ConfigError(f"field {name!r} is missing")
                continue
            want = int if f.type in ("int", int) else str
            v = doc[name]
            if type(v) is not want:
                raise ConfigError(f"field {name!r} must be a {want.__name__}, got {v!r}")
            values[name] = v
        inst = cls(**values)  # type: ignore[arg-type]
        inst.check()
        return inst

    def check(self) -> None:
        if self.role not in ROLES:
            raise ConfigError(f"role {self.role!r} is not one of {ROLES}")
        check_name(self.instance_id, "instance_id")
        for name in ("address", "bootstrap") if self.role == "prefill" else ("address",):
            _check_address(getattr(self, name), name)
        if self.dp_size < 1 or self.tp_size < 1:
            raise ConfigError(f"dp_size and tp_size must be >= 1, got {self.dp_size} and {self.tp_size}")
        if self.role != "bootstrap" and (not self.transport or not self.compat_hash):
            raise ConfigError(f"a {self.role} record needs transport and compat_hash")


def _check_address(addr: str, field: str) -> None:
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"field {field!r}: {addr!r} is not HOST:PORT")
    if host in ("0.0.0.0", "::", "[::]"):
        raise ConfigError(f"field {field!r}: {addr!r} is a wildcard, not an address peers can reach")


@dataclasses.dataclass(frozen=True)
class _Entry:
    instance: Instance
    create_revision: int
    signer: bytes | None = None  # the signer's key fingerprint; None: unsigned (nothing to check)
    proven: bool | None = None  # whether its address showed the signer's key; None: not yet known
    name: str | None = None  # the name the signer's certificate carries for its key (pdgrpc.rpc.certs.key_name)


Opener = Callable[[bytes], "tuple[bytes, frozenset[str] | None, bytes, str | None]"]
"""A signed value -> the record inside, the roles its signer may write (None: any), the
signer's key fingerprint and the name its certificate carries for that key (None: none);
raises ConfigError saying why a value is not taken."""

_LOGGED_SKIPS = 16  # distinct bad values logged one by one; past them, one line per _SKIP_LOG_EVERY
_SKIP_LOG_EVERY = 1000


class MembershipView:
    """The live instances under one cluster prefix, fed by etcd puts and deletes."""

    def __init__(self, prefix: str, opener: Opener | None = None, *, prove: bool = False) -> None:
        self.prefix = prefix
        self._open = opener
        self._prove = prove  # whether a signed record waits for prove() before it is listed
        self.ignored = 0  # values not taken (bad, unsigned, wrongly signed), counted on every put
        self.identity_mismatches = 0  # signed records whose address showed another key than the signer's
        self._entries: dict[str, _Entry] = {}
        self._skipped: set[str] = set()  # digests of (key, value) already logged as skipped
        self._skips = 0  # distinct values skipped
        self.version = 0  # bumped on every change of the routable set (for waiters and tests)
        self._cache: tuple[int, dict[str, list[Instance]]] = (-1, {})  # instances() per role, at a version
        self._names: tuple[int, dict[str, str]] = (-1, {})  # server_name() per address, at a version

    # ---- feeding ---------------------------------------------------------------------------

    def put(self, key: str, value: bytes, create_revision: int) -> None:
        where = self._parse_key(key)
        try:
            if where is None:
                raise ConfigError("key is not /pdgrpc/<cluster>/<role>/<instance id>")
            record, roles, signer, name = (value, None, None, None) if self._open is None else self._open(value)
            signer, name = (signer, name) if self._prove else (None, None)
            inst = Instance.from_json(record)
            if (inst.role, inst.instance_id) != where:
                raise ConfigError(f"record says {inst.role}/{inst.instance_id}, key says {where[0]}/{where[1]}")
            if roles is not None and inst.role not in roles:
                raise ConfigError(f"signed by a {'/'.join(sorted(roles))}'s certificate, not a {inst.role}'s")
        except ConfigError as exc:
            self.ignored += 1
            self._skip(key, value, f"ignored: {exc}")
            self._remove(key)  # a key overwritten with garbage no longer names a live instance
            return
        old = self._entries.get(key)
        # What the address showed holds while the address and the signer stay.
        same = old is not None and (old.instance.address, old.signer) == (inst.address, signer)
        self._entries[key] = _Entry(inst, create_revision, signer, old.proven if same and old is not None else None, name)
        if old is None or old.instance != inst or not same:
            self.version += 1
            what = "joined" if old is None else f"changed (generation {old.instance.generation} -> {inst.generation})"
            log.info("discovery: %s %s %s at %s (generation %d)", inst.role, inst.instance_id, what, inst.address, inst.generation)

    def unproven(self) -> list[tuple[str, str, bytes]]:
        """``(key, address, signer)`` of each signed record whose address has not yet
        shown the signer's key (see :meth:`prove`)."""
        return [(k, e.instance.address, e.signer) for k, e in self._entries.items() if e.signer is not None and e.proven is None]

    def prove(self, key: str, address: str, signer: bytes, shown: bytes | None) -> None:
        """The server at ``address`` showed key ``shown`` (None: a certificate the CA did
        not sign): ``key``'s instance is listed when that is its signer's, else never
        dialed (counted, logged once). Stale when the record changed meanwhile."""
        entry = self._entries.get(key)
        if entry is None or (entry.instance.address, entry.signer) != (address, signer) or entry.proven is not None:
            return
        ok = shown == signer
        self._entries[key] = dataclasses.replace(entry, proven=ok)
        if ok:
            self.version += 1
            return
        self.identity_mismatches += 1
        self._skip(key, address.encode() + b"\0" + signer, (
            f"ignored: the server at {address} shows another certificate than the record's signer; not dialed"
        ))

    def delete(self, key: str) -> None:
        entry = self._entries.get(key)
        if self._remove(key) and entry is not None:
            log.info("discovery: %s %s left (lease ended or key deleted)", entry.instance.role, entry.instance.instance_id)

    def reset(self, items: Iterable[tuple[str, bytes, int]]) -> None:
        """Replace the whole view with a fresh listing (after a reconnect: deletes missed
        while the watch was down are applied by their absence here)."""
        items = list(items)
        keys = {k for k, _, _ in items}
        for key in [k for k in self._entries if k not in keys]:
            self.delete(key)
        for key, value, rev in items:
            self.put(key, value, rev)

    def _remove(self, key: str) -> bool:
        if self._entries.pop(key, None) is None:
            return False
        self.version += 1
        return True

    def _parse_key(self, key: str) -> tuple[str, str] | None:
        if not key.startswith(self.prefix):
            return None
        parts = key[len(self.prefix):].split("/")
        if len(parts) != 2 or parts[0] not in ROLES or not _NAME.match(parts[1]):
            return None
        return parts[0], parts[1]

    def _skip(self, key: str, value: bytes, why: str) -> None:
        digest = hashlib.sha256(key.encode() + b"\0" + value).hexdigest()
        if digest in self._skipped:
            return
        if len(self._skipped) > 4096:  # bounded: a writer flooding the prefix cannot grow it forever
            self._skipped.clear()
        self._skipped.add(digest)
        self._skips += 1
        if self._skips <= _LOGGED_SKIPS:
            log.warning("discovery: key %s %s", key, why)
        elif self._skips % _SKIP_LOG_EVERY == 0:
            log.warning("discovery: %d values ignored so far (the last: key %s %s)", self.ignored, key[:200], why)

    # ---- reading ---------------------------------------------------------------------------

    def reference(self) -> tuple[str, str] | None:
        """``(compat_hash, transport)`` every routable prefill and decode must have: the
        oldest live prefill or decode's (lowest create revision, then key)."""
        workers = [(e.create_revision, k, e.instance) for k, e in self._entries.items() if e.instance.role != "bootstrap"]
        if not workers:
            return None
        _, _, oldest = min(workers, key=lambda t: (t[0], t[1]))
        return oldest.compat_hash, oldest.transport

    def instances(self, role: str) -> list[Instance]:
        """Live, compatible instances of ``role``, in key order (stable for round robin).
        Computed once per change of the view: the router asks on every request."""
        version, by_role = self._cache
        if version != self.version:
            by_role = {}
            self._cache = (self.version, by_role)
        if role not in by_role:
            by_role[role] = self._instances(role)
        return list(by_role[role])

    def _instances(self, role: str) -> list[Instance]:
        ref = self.reference()
        out = []
        for key in sorted(self._entries):
            entry = self._entries[key]
            inst = entry.instance
            if inst.role != role or (entry.signer is not None and not entry.proven):
                continue
            if role != "bootstrap" and ref is not None and (inst.compat_hash, inst.transport) != ref:
                self._skip(key, inst.to_json(), (
                    f"ignored: compatibility hash {inst.compat_hash[:12]} / transport {inst.transport} differs from "
                    f"the cluster's {ref[0][:12]} / {ref[1]} (its oldest live instance's)"
                ))
                continue
            out.append(inst)
        return out

    def server_name(self, address: str) -> str | None:
        """The TLS name a channel to ``address`` must see: the key name of the signer whose
        proven record names that address (None: no such record, or its certificate carries
        no key name). A router's channel pool pins each channel to it
        (``grpc.ssl_target_name_override``), so whatever answers there later, on any new
        connection, is the signer or is refused in the handshake."""
        version, names = self._names
        if version != self.version:
            names = {e.instance.address: e.name for e in self._entries.values() if e.proven and e.name is not None}
            self._names = (self.version, names)
        return names.get(address)

    def snapshot(self) -> Mapping[str, Instance]:
        return {k: e.instance for k, e in self._entries.items()}
