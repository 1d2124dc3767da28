"""One writer per ``store.url``: the lease object ``<store.url>/lease.json`` (docs/storage.md, "One run per prefix").

- A workflow run takes the lease when it starts (Snakemake's ``onstart``, before any job or output is touched):
  it creates the object only where there is none (a conditional write, ``If-None-Match``), or replaces an expired
  one only if it is still the one it read (``If-Match`` of its ETag). A lease held by a live run refuses the start
  with one sentence naming the holder. The object says who holds it (run id, host, process id, start time) and
  until when (``expires``, ``store.lease_seconds`` after its last renewal).
- While the run lasts a thread of its Snakemake process renews it every fifth of ``lease_seconds`` (again only if
  the object is still the one it wrote); the run releases it (deletes it, if it is still its own) when it ends.
  A killed run (kill -9, a lost node) leaves it to expire; the next run takes it over then, with a logged sentence.
- Every job that writes under ``store.url`` (extract, merge) first checks that the lease names its run
  (``DFLASH_STORE_LEASE``, set for the jobs by the run), and refuses to write otherwise.
- ``dflash-pipeline lease <store.url> [--break]`` says who holds it, and deletes the lease of a run its user knows
  is dead (``break_lease``).
- A holder that finds its lease taken over (it could not renew for ``lease_seconds``: a frozen process, a network
  cut) stops its Snakemake process at once, as kill -9 would, so that Snakemake deletes no output another run
  has written since.

Expiry compares the clocks of the hosts involved: they must agree to well under ``lease_seconds``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import socket
import threading
import time
import uuid
from datetime import datetime, timezone

from ..bucket import Bucket, BucketError, split_url

RUN_ID_VARIABLE = "DFLASH_STORE_LEASE"  # the run id of the lease, in the environment of the run's jobs
log = logging.getLogger(__name__)


class LeaseError(BucketError):
    """Another run holds the lease of a ``store.url``, or this run lost it: one sentence that names the holder."""


def lease_url(store_url: str) -> str:
    return f"{store_url.rstrip('/')}/lease.json"


def when(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


@dataclasses.dataclass
class Holder:
    """What the lease object says: who holds it, and until when."""

    run_id: str
    host: str
    pid: int
    started: float
    expires: float

    def describe(self) -> str:
        return (f"run {self.run_id} (host {self.host}, pid {self.pid}, started {when(self.started)}, "
                f"its lease expires {when(self.expires)} unless renewed)")

    def body(self) -> bytes:
        return json.dumps(dataclasses.asdict(self), sort_keys=True).encode()


def read_holder(store_url: str, bucket: Bucket) -> tuple[Holder, str] | None:
    """The lease of ``store_url`` and its ETag, or None when there is none."""
    import obstore

    url = lease_url(store_url)
    try:
        result = obstore.get(bucket.object_store(url), split_url(url)[1])
        data = bytes(result.bytes())
    except FileNotFoundError:
        return None
    except Exception as error:
        raise bucket.explain(url, error) from error
    try:
        return Holder(**json.loads(data)), result.meta["e_tag"]
    except (ValueError, TypeError) as error:
        raise LeaseError(f"{url} is not a lease this package wrote ({error}): delete it if no run writes "
                         f"{store_url}") from None


def _put(url: str, bucket: Bucket, holder: Holder, mode) -> str | None:
    """Write the lease conditionally (``mode``: "create", or the ETag it must still have) -> its new ETag, or None
    when the condition failed (another run wrote it first)."""
    import obstore
    from obstore.exceptions import AlreadyExistsError, PreconditionError

    try:
        result = obstore.put(bucket.object_store(url), split_url(url)[1], holder.body(),
                             mode="create" if mode == "create" else {"e_tag": mode})
    except (AlreadyExistsError, PreconditionError):
        return None
    except Exception as error:
        raise bucket.explain(url, error) from error
    return result["e_tag"]


class Lease:
    """This run's lease of ``store_url``: ``take()`` it, renewed in a thread until ``release()``."""

    def __init__(self, store_url: str, bucket: Bucket, seconds: float, run_id: str | None = None):
        self.store_url, self.url, self.bucket, self.seconds = store_url, lease_url(store_url), bucket, seconds
        self.holder = Holder(run_id or uuid.uuid4().hex[:12], socket.gethostname(), os.getpid(), time.time(), 0.0)
        self.e_tag: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def take(self) -> None:
        """Hold the lease (a ``LeaseError`` sentence when a live run holds it), then renew it in a thread."""
        self.holder.expires = time.time() + self.seconds
        self.e_tag = _put(self.url, self.bucket, self.holder, "create")
        if self.e_tag is None:
            found = read_holder(self.store_url, self.bucket)
            if found is not None and found[0].expires > time.time():
                raise LeaseError(
                    f"{self.store_url} is being written by {found[0].describe()}: one run writes a store.url at a "
                    "time; wait for it to end, or if it is dead (killed, its node lost) run again once its lease has "
                    "expired (this run then takes it over) or clear it now with `dflash-pipeline lease "
                    f"{self.store_url} --break` (docs/storage.md)")
            self.e_tag = _put(self.url, self.bucket, self.holder, found[1] if found else "create")
            if self.e_tag is None:
                raise LeaseError(f"{self.store_url}: another run took the lease {self.url} at the same moment; "
                                 "run again to see which")
            if found is not None:
                log.warning("took over the stale lease %s of %s: its holder did not renew it in time (killed, or "
                            "cut off from the bucket)", self.url, found[0].describe())
        found = read_holder(self.store_url, self.bucket)  # for servers that ignore the conditions
        if found is None or found[0].run_id != self.holder.run_id:
            raise LeaseError(f"{self.store_url}: the lease {self.url} did not keep this run's id: another run "
                             "wrote it at the same moment; run again to see which")
        os.environ[RUN_ID_VARIABLE] = self.holder.run_id
        self._thread = threading.Thread(target=self._renew, name="store-lease", daemon=True)
        self._thread.start()

    def _renew(self) -> None:
        while not self._stop.wait(self.seconds / 5):
            self.holder.expires = time.time() + self.seconds
            try:
                e_tag = _put(self.url, self.bucket, self.holder, self.e_tag)
            except BucketError as error:  # the bucket does not answer now: try again at the next turn
                log.warning("could not renew the lease %s: %s", self.url, error)
                continue
            if e_tag is None and not self._stop.is_set():
                found = read_holder(self.store_url, self.bucket)
                log.error("this run lost the lease %s to %s: it could not renew it for store.lease_seconds; stopping "
                          "this Snakemake process at once so that it deletes nothing that run wrote",
                          self.url, found[0].describe() if found else "nobody")
                os.kill(os.getpid(), signal.SIGKILL)
            self.e_tag = e_tag or self.e_tag

    def release(self) -> None:
        """Stop renewing and delete the lease if it is still this run's."""
        import obstore

        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        found = read_holder(self.store_url, self.bucket)
        if found is not None and found[0].run_id == self.holder.run_id:
            obstore.delete(self.bucket.object_store(self.url), split_url(self.url)[1])


def break_lease(store_url: str, bucket: Bucket, found: tuple[Holder, str]) -> None:
    """Delete the lease ``found`` (``read_holder``'s) of a run its user knows is dead; refused while the holder's
    process runs on this host."""
    import obstore

    holder = found[0]
    if holder.host == socket.gethostname():
        try:
            os.kill(holder.pid, 0)
        except ProcessLookupError:
            pass
        else:
            raise LeaseError(f"{store_url}: run {holder.run_id} still runs on this host (pid {holder.pid}): stop it "
                             "or wait for it to end; its lease is not broken")
    url = lease_url(store_url)
    obstore.delete(bucket.object_store(url), split_url(url)[1])


def check_held(settings: dict) -> None:
    """In a job that writes under ``store.url`` (``settings``: the ``store`` config section; nothing to check
    without a url): its run (``DFLASH_STORE_LEASE``) holds the lease, else a ``LeaseError`` before anything is
    written."""
    if not settings.get("url"):
        return
    store_url, run_id = settings["url"].rstrip("/"), os.environ.get(RUN_ID_VARIABLE)
    found = read_holder(store_url, Bucket(settings.get("endpoint_url"), settings.get("region")))
    if run_id is None or found is None or found[0].run_id != run_id or found[0].expires <= time.time():
        holder = found[0].describe() if found else "no run"
        raise LeaseError(f"this job's run ({run_id or 'none: Snakemake ran without its onstart hook'}) does not "
                         f"hold the lease of {store_url}, {holder} does: the job writes nothing there")
