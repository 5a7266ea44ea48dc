"""Interactive sessions without a browser: the job spec's ports, the launch spec, the agent's
report, who may see and share a session, the proxy's cookie rules and idle culling."""
from datetime import timedelta

import pytest
from django.utils import timezone

from portal.core.context import Actor
from portal.interactive.models import Session, SessionPolicy
from portal.interactive.proxy import _set_cookie_allowed, _strip_cookies
from portal.interactive.selectors import session_for_connect
from portal.interactive.services import sessions_cull
from portal.jobs.models import JobState
from portal.jobs.services import job_submit
from tests.conftest import agent_client, make_token

IMAGE = "gpuportal/busybox:latest"


@pytest.fixture(autouse=True)
def no_dispatch(monkeypatch):
    monkeypatch.setattr("scheduler.dispatch._send", lambda *a, **k: None)


def submit(client, **extra):
    body = {"project": "vision", "image": IMAGE, "command": ["jupyter", "lab"], **extra}
    return client.post("/api/v1/jobs/", data=body, format="json")


def lab_job(demo, user="alice", ports=None):
    job, _ = job_submit(actor=Actor(user=demo.users[user]), data={
        "project": "vision", "image": IMAGE, "command": ["jupyter", "lab"], "resources": {"gpus": 1},
        "ports": ports or [{"name": "lab", "kind": "jupyter"}, {"name": "sh", "kind": "terminal"}]})
    return job


def test_ports_make_one_session_each_with_its_own_secret(demo, api):
    r = submit(api("alice"), ports=[{"name": "lab", "kind": "jupyter"}, {"name": "tb", "kind": "http", "port": 6006}])
    assert r.status_code == 201, r.json()
    sessions = list(Session.objects.filter(job_id=r.json()["id"]).order_by("name"))
    assert [(s.name, s.kind, s.port, s.state) for s in sessions] == [("lab", "jupyter", None, "starting"),
                                                                     ("tb", "http", 6006, "starting")]
    assert len({s.secret for s in sessions}) == 2 and all(len(s.secret) >= 40 for s in sessions)


@pytest.mark.parametrize("ports, field, message", [
    ([{"name": "Lab!", "kind": "jupyter"}], "ports.0.name", "lower-case"),
    ([{"name": "tb", "kind": "http"}], "ports.0.port", "needs the port"),
    ([{"name": "tb", "kind": "http", "port": 80}], "ports.0.port", "greater than or equal to 1024"),
    ([{"name": "x", "kind": "ssh"}], "ports.0.kind", "not a valid choice"),
    ([{"name": "a", "kind": "http", "port": 8000}, {"name": "a", "kind": "terminal"}], "ports", "used twice"),
    ([{"name": "a", "kind": "http", "port": 8000}, {"name": "b", "kind": "http", "port": 8000}], "ports",
     "published twice"),
    ([{"name": "a", "kind": "jupyter"}, {"name": "b", "kind": "jupyter"}], "ports", "at most one JupyterLab"),
    ([{"name": f"p{i}", "kind": "terminal"} for i in range(9)], "ports", "no more than 8"),
    ("lab", "ports", "list"),
])
def test_bad_ports_are_400_with_the_field(demo, api, ports, field, message):
    r = submit(api("alice"), ports=ports)
    assert r.status_code == 400, r.json()
    fields = r.json()["error"]["fields"]
    assert field in fields and message in " ".join(fields[field]), fields
    assert not Session.objects.exists()


def test_the_kvm_sandbox_publishes_a_terminal_only(demo, api):
    r = submit(api("alice"), sandbox="kvm", ports=[{"name": "sh", "kind": "terminal"},
                                                   {"name": "lab", "kind": "jupyter"}])
    assert r.status_code == 400 and "terminal only" in r.json()["error"]["fields"]["ports"][0]
    r = submit(api("alice"), sandbox="kvm", ports=[{"name": "sh", "kind": "terminal"}])
    assert r.status_code == 201, r.json()
    assert list(Session.objects.filter(job_id=r.json()["id"]).values_list("kind", flat=True)) == ["terminal"]


def test_an_array_or_a_gang_cannot_publish_ports(demo, api):
    r = submit(api("alice"), array="0-3", ports=[{"name": "lab", "kind": "jupyter"}])
    assert r.status_code == 400 and "array" in r.json()["error"]["fields"]["ports"][0]


def test_the_launch_spec_carries_the_sessions(demo):
    from portal.launch import launch_specs

    job = lab_job(demo)
    spec = launch_specs([("gpu-01", job.pk)])
    assert spec == {}  # not placed: nothing to launch
    job.state = JobState.ASSIGNED
    job.save(update_fields=["state"])
    sessions = launch_specs([("gpu-01", job.pk)])[("gpu-01", job.pk)]["sessions"]
    lab, sh = Session.objects.filter(job=job).order_by("name")
    assert sessions == [
        {"name": "lab", "port": None, "kind": "jupyter", "secret": lab.secret_for(1), "base_url": f"/sessions/{job.pk}/lab/"},
        {"name": "sh", "port": None, "kind": "terminal", "secret": sh.secret_for(1), "base_url": f"/sessions/{job.pk}/sh/"}]
    # The session's own secret never leaves the portal: each attempt gets a key of its own.
    assert lab.secret not in {s["secret"] for s in sessions} and lab.secret_for(1) != lab.secret_for(2)
    job.attempt = 2
    job.save(update_fields=["attempt"])
    again = launch_specs([("gpu-01", job.pk)])[("gpu-01", job.pk)]["sessions"]
    assert [s["secret"] for s in again] == [lab.secret_for(2), sh.secret_for(2)]


@pytest.mark.django_db(transaction=True)  # the proxy's _load closes stale connections, as in its own threads
def test_a_new_attempts_key_goes_only_to_the_node_that_runs_it(demo):
    from portal.interactive.proxy import _load
    from portal.interactive.services import session_report

    job = lab_job(demo)
    Job = type(job)
    Job.objects.filter(pk=job.pk).update(state=JobState.RUNNING)
    job.refresh_from_db()
    alice = {b"authorization": f"Bearer {make_token(demo.users['alice'])}".encode()}
    lab = Session.objects.get(job=job, name="lab")
    session_report(node=None, job=job, attempt=1, name="lab", state="running", gateway_url="http://node-a:8790")
    info = _load(alice, str(job.pk), "lab")
    assert (info["gateway"], info["secret"]) == ("http://node-a:8790", lab.secret_for(1))
    # The job moves (a retry, a preemption): until attempt 2's node reports, nothing is sent to node A.
    Job.objects.filter(pk=job.pk).update(attempt=2)
    job.refresh_from_db()
    info = _load(alice, str(job.pk), "lab")
    assert info["gateway"] == "" and info["secret"] == lab.secret_for(2)
    session_report(node=None, job=job, attempt=1, name="lab", state="running", gateway_url="http://node-a:8790")
    assert _load(alice, str(job.pk), "lab")["gateway"] == ""  # the old attempt's report changes nothing
    session_report(node=None, job=job, attempt=2, name="lab", state="running", gateway_url="http://node-b:8790")
    info = _load(alice, str(job.pk), "lab")
    assert (info["gateway"], info["secret"]) == ("http://node-b:8790", lab.secret_for(2))


@pytest.fixture
def node_client(demo):
    return agent_client(demo)


def report(client, job, **body):
    return client.post(f"/api/agent/v1/jobs/{job.pk}/sessions", data={"attempt": job.attempt, **body}, format="json")


def test_the_agent_reports_a_session_running_on_its_own_node_only(demo, node_client):
    job = lab_job(demo)
    job.state, job.node = JobState.RUNNING, node_client.node
    job.save(update_fields=["state", "node"])
    r = report(node_client, job, name="lab", state="running", gateway_url="http://10.0.0.5:8790")
    assert r.status_code == 200 and r.json() == {"state": "running"}
    s = Session.objects.get(job=job, name="lab")
    assert s.gateway_url == "http://10.0.0.5:8790" and s.running_at is not None
    # Bad input is a 400 naming the field; another attempt or another node is stale (409).
    r = report(node_client, job, name="lab", state="running")
    assert r.status_code == 400 and "gateway_url" in r.json()["error"]["fields"]
    r = report(node_client, job, name="lab", state="running", gateway_url="file:///etc/passwd")
    assert r.status_code == 400 and "gateway_url" in r.json()["error"]["fields"]
    assert report(node_client, job, name="nope", state="running", gateway_url="http://x:1").status_code == 409
    stranger = agent_client(demo, "gpu-02", "1xH100-80GB")
    assert report(stranger, job, name="lab", state="ended").status_code == 409
    assert Session.objects.get(job=job, name="lab").state == "running"
    r = node_client.post(f"/api/agent/v1/jobs/{job.pk}/sessions", format="json",
                         data={"attempt": job.attempt + 1, "name": "lab", "state": "ended"})
    assert r.status_code == 409


def test_only_the_owner_and_then_the_project_may_connect(demo, api):
    job = lab_job(demo)
    alice, bob, charlie = (demo.users[u] for u in ("alice", "bob", "charlie"))
    assert session_for_connect(alice, job.pk, "lab") is not None
    assert session_for_connect(bob, job.pk, "lab") is None  # same project, not shared yet
    assert session_for_connect(charlie, job.pk, "lab") is None  # another tenant
    assert session_for_connect(demo.users["admin"], job.pk, "lab") is None  # staff do not get into apps
    assert session_for_connect(alice, "not-a-number", "lab") is None
    # Sharing is the owner's, through the API; outsiders do not see the session at all.
    sid = Session.objects.get(job=job, name="lab").pk
    assert api("charlie").get(f"/api/v1/sessions/{sid}/").status_code == 404
    assert api("charlie").patch(f"/api/v1/sessions/{sid}/", {"share": "project"}, format="json").status_code == 404
    assert api("bob").get(f"/api/v1/sessions/{sid}/").status_code == 404
    r = api("alice").patch(f"/api/v1/sessions/{sid}/", {"share": "everyone"}, format="json")
    assert r.status_code == 400 and "share" in r.json()["error"]["fields"]
    r = api("alice").patch(f"/api/v1/sessions/{sid}/", {"share": "project"}, format="json")
    assert r.status_code == 200 and r.json()["share"] == "project" and "secret" not in r.json()
    assert session_for_connect(bob, job.pk, "lab") is not None
    assert session_for_connect(charlie, job.pk, "lab") is None
    assert api("bob").get(f"/api/v1/sessions/{sid}/").status_code == 200
    assert api("bob").patch(f"/api/v1/sessions/{sid}/", {"share": "owner"}, format="json").status_code == 403
    listed = api("alice").get("/api/v1/sessions/", {"job": job.pk}).json()["results"]
    assert {s["name"]: s["url"] for s in listed} == {"lab": f"/sessions/{job.pk}/lab/", "sh": f"/sessions/{job.pk}/sh/"}


def test_the_owner_shares_a_session_with_named_people_of_its_organization(demo, api):
    from django.contrib.auth import get_user_model

    from portal.tenancy.models import Membership, Project

    job = lab_job(demo)
    alice, bob, charlie = (demo.users[u] for u in ("alice", "bob", "charlie"))
    # erin is in alice's organization (another of its projects), not in the job's project.
    erin = get_user_model().objects.create_user("erin", password="x-erin-pass-123")
    audio = Project.objects.create(organization=demo.vision.organization, slug="audio", name="Audio")
    Membership.objects.create(project=audio, user=erin, role="member")
    sid = Session.objects.get(job=job, name="lab").pk
    url = f"/api/v1/sessions/{sid}/"
    # Only members of the job's organization can be named; another tenant's user reads like an unknown name.
    for name in ("charlie", "nobody-such"):
        r = api("alice").patch(url, {"users": [name]}, format="json")
        assert r.status_code == 400, r.json()
        assert r.json()["error"]["fields"]["users"] == [f"No user named {name!r} in this job's organization."]
    r = api("alice").patch(url, {"users": ["erin", "charlie"]}, format="json")
    assert r.status_code == 400 and not Session.objects.get(pk=sid).shared_users.exists()  # all or nothing
    assert api("alice").patch(url, {}, format="json").status_code == 400
    assert api("alice").patch(url, {"users": "erin"}, format="json").status_code == 400
    assert api("bob").patch(url, {"users": ["bob"]}, format="json").status_code == 404  # not shared with him
    assert api("charlie").patch(url, {"users": ["charlie"]}, format="json").status_code == 404
    r = api("alice").patch(url, {"users": ["erin", "erin", "alice"]}, format="json")
    assert r.status_code == 200 and r.json()["users"] == ["erin"] and r.json()["share"] == "owner"
    # erin gets in to this session only; bob (same project, not named) and charlie still do not.
    assert session_for_connect(erin, job.pk, "lab") is not None
    assert session_for_connect(erin, job.pk, "sh") is None
    assert session_for_connect(bob, job.pk, "lab") is None
    assert session_for_connect(charlie, job.pk, "lab") is None
    listed = api("erin").get("/api/v1/sessions/").json()["results"]
    assert [(s["job"], s["name"]) for s in listed] == [(job.pk, "lab")]
    assert api("erin").get(url).status_code == 200
    assert api("erin").patch(url, {"users": []}, format="json").status_code == 403  # the owner's to change
    # Checked at every connection: once erin leaves the organization, she is out.
    Membership.objects.filter(user=erin).delete()
    assert session_for_connect(erin, job.pk, "lab") is None
    assert api("erin").get(url).status_code == 404
    Membership.objects.create(project=audio, user=erin, role="member")
    # An empty list takes everyone's name back.
    r = api("alice").patch(url, {"users": []}, format="json")
    assert r.status_code == 200 and r.json()["users"] == []
    assert session_for_connect(erin, job.pk, "lab") is None


def test_a_token_needs_the_submit_scope_and_the_jobs_project(demo):
    from portal.accounts.services import token_authenticate

    job = lab_job(demo)
    alice = demo.users["alice"]
    read_only = token_authenticate(make_token(alice, scopes=("read",)))
    full = token_authenticate(make_token(alice))
    other_project = token_authenticate(make_token(alice, project=demo.nlp)) if alice.pk else None
    assert session_for_connect(alice, job.pk, "lab", token=read_only) is None
    assert session_for_connect(alice, job.pk, "lab", token=full) is not None
    assert session_for_connect(alice, job.pk, "lab", token=other_project) is None


def test_the_app_never_sees_nor_sets_the_portals_cookies(settings):
    raw = f"{settings.SESSION_COOKIE_NAME}=abc; _xsrf=2|x; {settings.CSRF_COOKIE_NAME}=tok; username-h=\"2|1\""
    assert _strip_cookies(raw) == '_xsrf=2|x; username-h="2|1"'
    prefix = "/sessions/5/lab/"
    assert _set_cookie_allowed("_xsrf=1; Path=/sessions/5/lab/", prefix)
    assert not _set_cookie_allowed("_xsrf=1; Path=/", prefix)  # would reach the whole portal
    assert not _set_cookie_allowed("_xsrf=1", prefix)  # no path: the request's, which is the portal's
    assert not _set_cookie_allowed(f"{settings.SESSION_COOKIE_NAME}=x; Path=/sessions/5/lab/", prefix)
    assert not _set_cookie_allowed("a=1; Path=/sessions/5/lab/; Domain=example.com", prefix)
    assert not _set_cookie_allowed("a=1; Path=/sessions/55/lab/", "/sessions/5/")


def test_idle_sessions_are_warned_then_their_jobs_stopped(demo, settings):
    settings.SESSION_IDLE_GRACE_S = 300
    job = lab_job(demo)
    job.state = JobState.RUNNING
    job.save(update_fields=["state"])
    SessionPolicy.objects.create(project=demo.vision, idle_timeout_s=600, max_lifetime_s=0)
    now = timezone.now()
    Session.objects.filter(job=job).update(state="running", running_at=now - timedelta(hours=2),
                                           last_activity_at=now - timedelta(seconds=601))
    # No traffic, but its GPU computes (the idle detector has not flagged it): not idle.
    assert sessions_cull(now) == {"ended": 0, "warned": 0, "stopped": 0, "mailed": 0}
    job.idle_since = now - timedelta(minutes=30)
    job.save(update_fields=["idle_since"])
    assert sessions_cull(now) == {"ended": 0, "warned": 2, "stopped": 0, "mailed": 1}
    assert set(Session.objects.filter(job=job).values_list("state", flat=True)) == {"idle"}
    assert sessions_cull(now + timedelta(seconds=299))["stopped"] == 0  # still within the warning's grace
    assert sessions_cull(now + timedelta(seconds=301))["stopped"] == 1
    job.refresh_from_db()
    assert job.state == JobState.CANCELLED and "idle for 600 s" in job.reason_message
    assert sessions_cull(now + timedelta(seconds=400))["ended"] == 2


def test_traffic_brings_an_idle_session_back_and_the_lifetime_still_ends_it(demo, settings):
    from portal.interactive.services import session_touch

    job = lab_job(demo)
    job.state = JobState.RUNNING
    job.save(update_fields=["state"])
    SessionPolicy.objects.create(project=demo.vision, idle_timeout_s=600, max_lifetime_s=3600)
    now = timezone.now()
    Session.objects.filter(job=job).update(state="idle", warned_at=now, running_at=now - timedelta(minutes=30),
                                           last_activity_at=now - timedelta(minutes=20))
    lab = Session.objects.get(job=job, name="lab")
    assert session_touch(lab.pk, None)
    lab.refresh_from_db()
    assert lab.state == "running" and lab.warned_at is None
    assert not session_touch(lab.pk, timezone.now())  # written a moment ago: no second write
    assert sessions_cull(now + timedelta(minutes=31))["stopped"] == 1  # 61 minutes since it started
    job.refresh_from_db()
    assert "maximum lifetime" in job.reason_message


def idle_lab(demo, clock, settings, *, idle_timeout_s=600):
    settings.SESSION_IDLE_GRACE_S = 300
    settings.PORTAL_URL = "https://portal.example"
    job = lab_job(demo)
    job.state = JobState.RUNNING
    job.idle_since = clock() - timedelta(minutes=30)  # the idle detector flagged its GPU
    job.save(update_fields=["state", "idle_since"])
    SessionPolicy.objects.create(project=demo.vision, idle_timeout_s=idle_timeout_s, max_lifetime_s=0)
    Session.objects.filter(job=job).update(state="running", running_at=clock() - timedelta(hours=2),
                                           last_activity_at=clock() - timedelta(seconds=idle_timeout_s - 60))
    return job


def test_the_owner_is_mailed_once_per_idle_period_when_to_stop_and_how_to_keep_it(demo, clock, settings, client):
    from django.core import mail

    from portal.interactive.services import session_touch

    job = idle_lab(demo, clock, settings)
    assert sessions_cull()["mailed"] == 0 and mail.outbox == []  # 9 minutes without traffic: not yet
    clock.advance(minutes=1, seconds=1)
    warned_at = clock()
    assert sessions_cull() == {"ended": 0, "warned": 2, "stopped": 0, "mailed": 1}  # both sessions, one mail
    (sent,) = mail.outbox
    stop_at = warned_at + timedelta(seconds=300)
    assert sent.to == [demo.users["alice"].email]
    assert f"stops at {stop_at:%H:%M} UTC" in sent.subject and f"job {job.pk}" in sent.subject
    assert f"stopped at {stop_at:%Y-%m-%d %H:%M} UTC" in sent.body and "no traffic for 10 minutes" in sent.body
    assert "To keep it, use it" in sent.body
    assert f"https://portal.example/sessions/{job.pk}/lab/" in sent.body
    assert f"https://portal.example/sessions/{job.pk}/sh/" in sent.body
    client.force_login(demo.users["alice"])  # the card says the same
    assert f"stops at {stop_at:%H:%M} UTC unless used" in client.get("/").content.decode()
    for _ in range(3):  # later culling ticks within the grace: no second mail
        clock.advance(minutes=1)
        assert sessions_cull() == {"ended": 0, "warned": 0, "stopped": 0, "mailed": 0}
    assert len(mail.outbox) == 1
    # Traffic ends the idle period; a new one mails again.
    lab = Session.objects.get(job=job, name="lab")
    assert session_touch(lab.pk, None)
    Session.objects.filter(job=job, name="sh").update(state="running", warned_at=None, last_activity_at=clock())
    clock.advance(minutes=10, seconds=1)
    assert sessions_cull()["mailed"] == 1 and len(mail.outbox) == 2
    assert f"stops at {clock() + timedelta(seconds=300):%H:%M} UTC" in mail.outbox[1].subject


def test_an_owner_who_opted_out_of_idle_mail_gets_the_warning_without_one(demo, clock, settings):
    from django.core import mail

    from portal.accounts.models import NotificationPreference

    NotificationPreference.objects.update_or_create(user=demo.users["alice"], defaults={"job_idle": False})
    job = idle_lab(demo, clock, settings)
    clock.advance(minutes=2)
    assert sessions_cull() == {"ended": 0, "warned": 2, "stopped": 0, "mailed": 0}
    assert mail.outbox == []
    assert set(Session.objects.filter(job=job).values_list("state", flat=True)) == {"idle"}
