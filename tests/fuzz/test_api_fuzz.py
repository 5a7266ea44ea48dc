"""The REST and agent APIs fuzzed from their OpenAPI schema (schemathesis), once per kind of caller.

Every operation gets a bounded number of generated requests, valid and invalid (random and real
path values: other tenants' slugs, usernames and ids), sent through the WSGI application with the
caller's token. Two rules hold for every answer:

1. No 5xx: bad input is a 4xx with a message, never a crash.
2. No answer names another tenant's objects: an identifier the caller may not see (an
   organization, project, user or node) appears in no response, unless the caller itself sent it
   in the query or body (an echo in an error message is not a leak).

The examples are derandomized, so CI runs the same requests every time; GPUPORTAL_FUZZ_EXAMPLES
raises the count for a longer local run.
"""
import itertools
import json
import os
import re
from datetime import timedelta

import pytest
import schemathesis
from django.core.signals import got_request_exception, request_finished, request_started
from django.db import close_old_connections, transaction
from hypothesis import HealthCheck, Phase, given, settings, strategies as st
from schemathesis.generation import GenerationMode

from portal.core.context import Actor
from portal.jobs.services import job_submit
from portal.nodes.services import node_add
from portal.tenancy.services import membership_add
from tests.conftest import make_token

EXAMPLES = int(os.environ.get("GPUPORTAL_FUZZ_EXAMPLES", "5"))
IMAGE = "gpuportal/busybox:latest"


def _load_schema():
    from drf_spectacular.generators import SchemaGenerator

    return schemathesis.openapi.from_dict(SchemaGenerator().get_schema(request=None, public=True))


SCHEMA = _load_schema()
OPERATIONS = {f"{op.method.upper()} {op.path}": op for op in (r.ok() for r in SCHEMA.get_all_operations())}

# Who calls, and what each may never see. charlie owns globex/nlp where alice is also a member;
# alice's restricted token is bound to vision; bob (member) and dave (viewer) are in vision only.
PERSONAS = {
    "staff": [],
    "owner": ["acme", "vision", "Computer vision", "bob", "dave"],
    "member": ["globex", "nlp", "Language models", "charlie"],
    "viewer": ["globex", "nlp", "Language models", "charlie"],
    "restricted": ["globex", "nlp", "Language models", "charlie"],
    "node": ["gpu-fz2", "acme", "globex"],
}
CASES = [(persona, name) for persona in PERSONAS for name in OPERATIONS
         if name.split(" ", 1)[1].startswith("/api/agent/") == (persona == "node")]


@pytest.fixture
def world(demo, monkeypatch):
    """Tokens for each persona, jobs in both tenants, two nodes: real objects to aim at."""
    monkeypatch.setattr("scheduler.dispatch._send", lambda *a, **k: None)
    users = demo.users
    membership_add(actor=Actor(user=users["charlie"]), project=demo.nlp, username="alice", role="member")
    jobs = [job_submit(actor=Actor(user=users[who]), data={
        "project": project, "name": f"fz-{who}", "image": IMAGE, "command": ["true"], "resources": {"gpus": 1}})[0]
        for who, project in (("alice", "vision"), ("bob", "vision"), ("charlie", "nlp"))]
    node, node_secret = node_add(actor=Actor(user=users["admin"]), name="gpu-fz1", gpus="2xH100-80GB")
    other, _ = node_add(actor=Actor(user=users["admin"]), name="gpu-fz2", gpus="2xH100-80GB")
    tokens = {
        "staff": make_token(users["admin"]),
        "owner": make_token(users["charlie"]),
        "member": make_token(users["bob"]),
        "viewer": make_token(users["dave"], ["read"]),
        "restricted": make_token(users["alice"], project=demo.vision),
        "node": node_secret,
    }
    from portal.accounts.models import ApiToken

    real = {
        "slug": ["vision", "nlp", "acme", "globex"], "project_slug": ["vision", "nlp"],
        "username": ["alice", "bob", "charlie", "dave"], "name": ["gpu-fz1", "gpu-fz2"],
        "id": sorted({j.pk for j in jobs} | set(ApiToken.objects.values_list("pk", flat=True)[:4])),
        "job_id": [str(j.pk) for j in jobs],
    }
    forbidden = {"node": [g.uuid for g in other.gpus.all()]}
    return type("World", (), {"tokens": tokens, "real": real, "forbidden": forbidden, "node": node})


@pytest.fixture
def app():
    """The WSGI application, called in the test's transaction: like Django's test client, keep
    request signals from closing the connection that holds it."""
    from portal.wsgi import application

    errors = []

    def record(sender, request=None, **kwargs):
        import traceback

        errors.append(traceback.format_exc())

    request_started.disconnect(close_old_connections)
    request_finished.disconnect(close_old_connections)
    got_request_exception.connect(record)
    try:
        yield type("App", (), {"wsgi": application, "errors": errors})
    finally:
        got_request_exception.disconnect(record)
        request_started.connect(close_old_connections)
        request_finished.connect(close_old_connections)


def strategy(operation, real):
    """Generated requests, valid and invalid, plus ones aimed at real objects of both tenants."""
    modes = [operation.as_strategy(generation_mode=GenerationMode.POSITIVE),
             operation.as_strategy(generation_mode=GenerationMode.NEGATIVE)]
    names = [p.name for p in operation.path_parameters]
    if names and all(n in real for n in names):
        combos = list(itertools.product(*(real[n] for n in names)))[:8]
        modes += [operation.as_strategy(path_parameters=dict(zip(names, combo))) for combo in combos]
    return st.one_of(modes)


def sent_text(case) -> str:
    """What the caller sent besides the path: an echo of it is not a leak."""
    body = case.body if not hasattr(case.body, "__class__") or case.body.__class__.__name__ != "NotSet" else None
    return json.dumps([case.query, body, case.headers], default=str)


@pytest.mark.django_db
@pytest.mark.parametrize("persona,operation", CASES, ids=[f"{p}-{o}" for p, o in CASES])
def test_fuzz(world, app, persona, operation):
    op = OPERATIONS[operation]
    headers = {"Authorization": f"Bearer {world.tokens[persona]}"}
    words = PERSONAS[persona] + world.forbidden.get(persona, [])
    patterns = [(w, re.compile(rf"(?<![\w-]){re.escape(w)}(?![\w-])")) for w in words]

    @settings(max_examples=EXAMPLES, deadline=timedelta(seconds=10), derandomize=True, database=None,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(case=strategy(op, world.real))
    def check(case):
        del app.errors[:]
        with transaction.atomic():  # each request on its own, as in production: no state or abort carries over
            response = case.call(app=app.wsgi, headers=headers, cookies={})
            transaction.set_rollback(True)
        assert response.status_code < 500, (f"{case.method} {case.formatted_path} -> {response.status_code}\n"
                                            f"{case.as_curl_command()}\n" + "\n".join(app.errors[-1:]))
        text, sent = response.text, sent_text(case)
        leaked = [w for w, pattern in patterns if pattern.search(text) and not pattern.search(sent)]
        assert not leaked, f"{persona} saw {leaked} in {case.method} {case.formatted_path}: {text[:500]}"

    check()
