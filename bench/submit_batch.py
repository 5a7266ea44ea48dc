"""Batch submit: N jobs in one POST /api/v1/jobs/batch/ (issue 14: 10,000 in under 5 s).

Through the whole API stack in process (DRF's APIClient: JSON parsing, authentication, the
checks, one bulk insert, the audit record), on a throwaway PostgreSQL database. Each job has
its own name and environment; they share the rest through `defaults`. Also times the same
number of single submits for comparison (first 200, scaled).

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/postgres .venv/bin/python bench/submit_batch.py [10000]
"""
import json
import os
import sys
import time
from decimal import Decimal

from benchdb import DEVELOPMENT, django_setup, throwaway_database

django_setup(DEVELOPMENT)
from django.core.management import call_command  # noqa: E402
from django.test.utils import override_settings  # noqa: E402


def main():
    from django.contrib.auth import get_user_model
    from rest_framework.test import APIClient

    from portal.core import queue
    from portal.jobs.models import Job
    from portal.tenancy.models import Quota

    n = int(sys.argv[1]) if len(sys.argv) > 1 else 10_000
    queue.send = lambda *a, **k: True  # no broker needed: the pass request is not what is measured
    with throwaway_database("gpuportal_bench_batch"), override_settings(ALLOWED_HOSTS=["*"]):
        call_command("seed_demo", stdout=open(os.devnull, "w"))
        Quota.objects.update(max_gpus=Decimal(1000), gpu_hours_budget=None)
        client = APIClient()
        client.force_login(get_user_model().objects.get(username="alice"))
        body = {"defaults": {"project": "vision", "image": "gpuportal/busybox:latest", "command": ["true"],
                             "resources": {"gpus": 1}, "time_limit": "10m"},
                "jobs": [{"name": f"sweep-{i}", "env": {"SEED": str(i)}} for i in range(n)]}
        raw = json.dumps(body)
        t = time.perf_counter()
        r = client.generic("POST", "/api/v1/jobs/batch/", raw, content_type="application/json")
        batch_s = time.perf_counter() - t
        assert r.status_code == 201, r.content[:500]
        assert Job.objects.count() == n
        single = 200
        spec = {**body["defaults"], "name": "one"}
        t = time.perf_counter()
        for _ in range(single):
            assert client.post("/api/v1/jobs/", spec, format="json").status_code == 201
        single_s = (time.perf_counter() - t) / single
        print(f"batch submit of {n} jobs ({len(raw) / 1e6:.2f} MB): {batch_s:.2f} s, {n / batch_s:,.0f} jobs/s  | "
              f"single submits: {single_s * 1000:.1f} ms each, {1 / single_s:.0f}/s "
              f"({n} would take {n * single_s:.0f} s)")


if __name__ == "__main__":
    main()
