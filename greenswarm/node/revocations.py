"""A site's watch on the swarm's revocation lists (:mod:`greenswarm.security.revocation`).

Every few seconds, on a thread of its own, it reads the lists stored under ``<swarm>_revocations``
and applies the newest to this process's admission (which the swarm view and the state checks
read) and to the averager process's (which checks join requests, groups and state downloads); the
site's DHT process applies each list itself as it passes through its record validator. A site that
finds itself revoked says so and stops (:attr:`RevocationWatch.revoked_self`). The newest list the
site knows is stored again every ``restore_s``, so it stays on the DHT while the swarm runs.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from greenswarm.security.admission import Admission
from greenswarm.security.certificates import CertificateError
from greenswarm.security.records import MAX_TTL_S
from greenswarm.security.revocation import revocations_key

log = logging.getLogger(__name__)


class RevocationWatch:
    """Reads, applies and keeps the swarm's revocation lists for one site (see the module doc).

    ``apply`` is called with the bytes of each newer list (the averager process's admission);
    ``store_s`` how often the newest known list is stored again."""

    def __init__(
        self,
        dht: Any,
        admission: Admission,
        me: str,
        apply: Callable[[bytes], None] | None = None,
        poll_s: float = 2.0,
        store_s: float = 3600.0,
    ):
        self.dht, self.admission, self.me = dht, admission, me
        self.apply = apply or (lambda blob: None)
        self.poll_s, self.store_s = poll_s, store_s
        self.revoked_self: str | None = None  # why this site itself was revoked (then it stops)
        self._pending: bytes | None = None  # a list the averager process has not taken yet
        self._stored_serial = -1
        self._stored_at = -float("inf")
        self._stop = threading.Event()
        if admission.revocations is not None:  # a list from the config's file: in force from the start
            self._applied(admission.revocation_bytes)
        self._thread = threading.Thread(target=self._run, name="revocations", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.poll_now()
            except Exception as e:  # never the end of the watch: the next poll tries again
                log.warning("the revocation watch failed a poll: %r", e)
            self._stop.wait(self.poll_s)

    def poll_now(self) -> None:
        """Read the stored lists, apply the newest if it is newer, store the newest known if due."""
        try:
            found = self.dht.get(revocations_key(self.admission.swarm), latest=True)
        except Exception as e:  # the DHT may be shutting down or briefly unreachable
            log.debug("reading the revocation lists failed: %r", e)
            found = None
        entries = found.value.values() if found is not None and isinstance(found.value, dict) else []
        for item in sorted(entries, key=_serial_of):
            blob = getattr(item, "value", None)
            if not isinstance(blob, bytes):
                continue
            try:
                applied = self.admission.revoke(blob, "a revocation list on the DHT")
            except CertificateError as e:  # (the DHT validator refuses these already)
                log.debug("ignoring a revocation list: %s", e)
                continue
            if applied is not None:
                log.warning(
                    "revocation list #%d in force: %d member(s) revoked", applied.serial, len(applied.entries)
                )
                self._applied(blob)
        if self._pending is not None:
            self._applied(self._pending)
        self._store_if_due()

    def _applied(self, blob: bytes) -> None:
        try:
            self.apply(blob)
        except Exception as e:  # the averager process busy or gone: this process applied it; retried below
            log.warning("could not apply the revocation list in the averager process yet: %s", e or repr(e))
            self._pending = blob
        else:
            self._pending = None
        why = self.admission.revoked(self.me, self.admission.certificate)
        if why is not None and self.revoked_self is None:
            self.revoked_self = why
            log.error("this site is no longer a member: %s", why)

    def _store_if_due(self) -> None:
        revocations = self.admission.revocations
        if revocations is None:
            return
        if revocations.serial == self._stored_serial and time.monotonic() - self._stored_at < self.store_s:
            return
        from hivemind.utils import get_dht_time

        try:
            stored = self.dht.store(
                revocations_key(self.admission.swarm),
                self.admission.revocation_bytes,
                get_dht_time() + MAX_TTL_S / 2,
                subkey=revocations.serial,
            )
        except Exception as e:
            log.debug("storing the revocation list failed: %r", e)
            return
        if stored:
            self._stored_serial, self._stored_at = revocations.serial, time.monotonic()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def _serial_of(item: Any) -> int:
    """A stored list's serial, for the order lists are applied in (its own says; garbage sorts first)."""
    import json

    try:
        return int(json.loads(item.value)["revocations"]["serial"])
    except Exception:
        return -1


def publish(initial_peers: list[str], admission: Admission, timeout_s: float = 30.0) -> bool:
    """Store ``admission``'s revocation list on the swarm's DHT from a reader of its own (the operator's
    machine holds no membership: the authority's signature is what every node checks). True when the
    DHT took it."""
    from hivemind.utils import get_dht_time

    from greenswarm.node.progress import open_reader
    from greenswarm.procs import reap_children

    revocations = admission.revocations
    assert revocations is not None, "nothing to publish"
    dht = open_reader(initial_peers, admission.swarm, admission=admission)
    try:
        future = dht.store(
            revocations_key(admission.swarm),
            admission.revocation_bytes,
            get_dht_time() + MAX_TTL_S / 2,
            subkey=revocations.serial,
            return_future=True,
        )
        try:
            return bool(future.result(timeout=timeout_s))
        except Exception as e:  # no DHT node answered in time: the caller says so, in one line
            log.warning("storing the revocation list on the DHT failed: %r", e)
            return False
    finally:
        dht.shutdown()
        reap_children()


def run_revoke(args: Any) -> int:
    """``greenswarm swarm revoke``: add members to the revocation list file and, given
    ``--initial-peers``, store the list on the swarm's DHT."""
    import json

    from greenswarm.errors import SwarmError
    from greenswarm.security.certificates import load_authority, raw_public
    from greenswarm.security.revocation import revoke

    revocations, blob = revoke(
        args.key,
        swarm=args.swarm,
        out=args.out,
        peer_ids=args.peer_id or [],
        certificates=args.cert or [],
        reason=args.reason or "",
    )
    admission = Admission(swarm=args.swarm, authority=raw_public(load_authority(args.key).public_key()))
    admission.revoke(blob, args.out)
    published = None
    if args.initial_peers:
        published = publish(args.initial_peers, admission)
        if not published:
            raise SwarmError(
                f"wrote {args.out}, but the swarm's DHT did not take the list; give the file to the sites "
                "(swarm.revocations) or try again"
            )
    entries = [
        {"peer_id": e.peer_id, "certificate": e.certificate, "reason": e.reason} for e in revocations.entries
    ]
    result = {
        "revocations": args.out,
        "serial": revocations.serial,
        "entries": entries,
        "published": published,
    }
    where = " and stored on the swarm's DHT" if published else " (give it to the sites, or --initial-peers)"
    text = f"{args.out}: revocation list #{revocations.serial}, {len(entries)} revoked{where}"
    print(json.dumps(result) if args.json else text)
    return 0
