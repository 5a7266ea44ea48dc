"""The agent's job reports (confirm, events, a batch of events, log chunks, launch progress, registry
logins) are checked by one
serializer instance per class (portal.core.api.validated) instead of one built per request: it
must take and refuse exactly what a fresh serializer takes and refuses, with the same field-level
messages, and a refused body must leave nothing behind for the next one."""
import copy

import pytest
from rest_framework import serializers

from portal.agentapi.images import ProgressSerializer, RegistryAuthSerializer
from portal.agentapi.jobs import AttemptSerializer, EventSerializer, EventsSerializer, LogSerializer
from portal.core.api import validated

EVENT = {"attempt": 1, "state": "running"}
END = {"job_id": "17", "attempt": 1, "state": "succeeded", "exit_code": 0}

BODIES = {
    AttemptSerializer: [
        {"attempt": 0}, {"attempt": 2**31 - 1}, {"attempt": "3"},  # DRF takes a string number
        {"attempt": -1}, {"attempt": 2**31}, {"attempt": None}, {"attempt": True}, {"attempt": 1.5},
        {}, {"attempt": 1, "extra": 1}, None, [], "attempt", [{"attempt": 1}],
    ],
    EventSerializer: [
        EVENT, {"attempt": 1, "state": "succeeded", "exit_code": 0, "message": "  done  "},
        {"attempt": 1, "state": "failed", "exit_code": -(2**31), "message": "", "node_problem": "sandbox stuck",
         "lease_expired": True, "not_startable": "", "scrub_failures": [{"gpu_index": 3, "message": "ecc"}]},
        {"attempt": 1, "state": "failed", "lease_expired": "true", "exit_code": "7"},
        {**EVENT, "state": "exploded"}, {**EVENT, "state": 5}, {**EVENT, "exit_code": 2**31},
        {**EVENT, "message": 5}, {**EVENT, "message": None}, {**EVENT, "message": "x" * 100_000},
        {**EVENT, "message": "a\x00b"}, {**EVENT, "node_problem": "\ud800"}, {**EVENT, "lease_expired": "maybe"},
        {**EVENT, "scrub_failures": [{"gpu_index": 1024, "message": "x"}, {"gpu_index": 0}]},
        {**EVENT, "scrub_failures": [{"gpu_index": 0, "message": "x", "more": 1}]},
        {**EVENT, "scrub_failures": [{"gpu_index": 0, "message": "x"}] * 65}, {**EVENT, "scrub_failures": "x"},
        {**EVENT, "scrub_failures": None}, {"state": "running"}, {**EVENT, "job_id": "17"}, None, [EVENT],
    ],
    EventsSerializer: [
        {"events": [END]}, {"events": [END, {**END, "job_id": "18", "state": "failed", "exit_code": None}]},
        {"events": [END] * 1000}, {"events": []}, {"events": END}, {"events": None}, {},
        {"events": [END, {**END, "attempt": -1}, {**END, "job_id": 17}]},
        {"events": [END, {**END, "job_id": "x" * 65}]},
        {"events": [{**END, "scrub_failures": [{"gpu_index": -1, "message": ""}]}]},
        {"events": [{k: v for k, v in END.items() if k != "job_id"}]}, {"events": [END], "more": []},
        {"events": ["not an event"]}, None,
    ],
    LogSerializer: [
        {"attempt": 1, "offset": 0, "data": "done\n"}, {"attempt": 1, "offset": 5, "data": "a\x00b"},
        {"attempt": 1, "offset": 0, "data": "\ud800"}, {"attempt": 1, "offset": 0, "data_base64": "aGk="},
        {"attempt": 1, "offset": 0, "data": ""}, {"attempt": 1, "offset": 0, "data_base64": "not base64!"},
        {"attempt": 1, "offset": 0}, {"attempt": 1, "offset": 0, "data": "x", "data_base64": "eA=="},
        {"attempt": 1, "offset": -1, "data": "x"}, {"attempt": 1, "offset": 0, "data": 5}, None,
    ],
    ProgressSerializer: [
        {"attempt": 1, "stage": "pulling", "message": "Pulling image busybox"},
        {"attempt": 1, "stage": "pulling", "message": "  padded  "}, {"attempt": 1, "stage": "pulling", "message": ""},
        {"attempt": 1, "stage": "sleeping", "message": "x"}, {"attempt": 1, "stage": "pulling", "message": 5},
        {"attempt": 1, "stage": "pulling", "message": "x" * 100_000}, {"attempt": 1, "stage": "pulling"}, None,
    ],
    RegistryAuthSerializer: [{"attempt": 1}, {"attempt": -1}, {"attempt": 1, "registry": "x"}, [], None],
}
CASES = [(cls, body) for cls, bodies in BODIES.items() for body in bodies]


def fresh(cls, body):
    """What a serializer built for the request gives: ("ok", data) or ("refused", errors)."""
    serializer = cls(data=copy.deepcopy(body))
    if serializer.is_valid():
        return "ok", serializer.validated_data
    return "refused", serializer.errors


def shared(cls, body):
    try:
        return "ok", validated(cls, copy.deepcopy(body))
    except serializers.ValidationError as exc:
        return "refused", exc.detail


def with_codes(value):
    """Errors with each message's code (ErrorDetail compares equal to its bare text)."""
    if isinstance(value, dict):
        return {key: with_codes(v) for key, v in value.items()}
    if isinstance(value, list):
        return [with_codes(v) for v in value]
    return (str(value), getattr(value, "code", None))


@pytest.mark.parametrize(("cls", "body"), CASES)
def test_the_shared_serializer_takes_and_refuses_what_a_fresh_one_does(cls, body):
    outcome, got = shared(cls, body)
    reference, expected = fresh(cls, body)
    assert outcome == reference
    assert with_codes(got) == with_codes(expected)


def test_both_outcomes_occur_for_each_report():
    # The cases above test something: each serializer takes some bodies and refuses others.
    for cls, bodies in BODIES.items():
        assert {fresh(cls, body)[0] for body in bodies} == {"ok", "refused"}, cls.__name__


def test_a_refused_body_leaves_nothing_for_the_next():
    # Every bad body, then a good one: the good one's data is the fresh serializer's, every time.
    for cls, bodies in BODIES.items():
        good = next(body for body in bodies if fresh(cls, body)[0] == "ok")
        for body in bodies:
            shared(cls, body)
            assert shared(cls, good) == fresh(cls, good)


def test_the_shared_serializer_gives_fresh_defaults_each_time():
    # scrub_failures defaults to a new list: what a caller adds to one report is not in the next.
    first = validated(EventSerializer, dict(EVENT))
    first["scrub_failures"].append({"gpu_index": 0, "message": "x"})
    assert validated(EventSerializer, dict(EVENT))["scrub_failures"] == []


@pytest.mark.parametrize(("path", "body", "field"), [
    ("confirm", {"attempt": -1}, "attempt"),
    ("confirm", {"attempt": 1, "extra": 1}, "extra"),
    ("events", {"attempt": 1, "state": "exploded"}, "state"),
    ("events", {"attempt": 1, "state": "failed", "scrub_failures": [{"gpu_index": 9999, "message": "x"}]},
     "scrub_failures"),
    ("logs", {"attempt": 1, "offset": 0, "data_base64": "not base64!"}, "data_base64"),
])
def test_a_bad_report_is_a_400_naming_the_field(starting, path, body, field):
    r = starting.post(f"/api/agent/v1/jobs/{starting.job.pk}/{path}", body, format="json")
    assert r.status_code == 400, r.content
    assert field in str(r.json()["error"]["fields"])
    # The job is untouched, and a good report afterwards is taken.
    r = starting.post(f"/api/agent/v1/jobs/{starting.job.pk}/events", {"attempt": 1, "state": "running"},
                      format="json")
    assert r.status_code == 200, r.content
    assert r.json() == {"result": "applied"}


def test_a_bad_batch_names_the_event_and_its_field(starting):
    r = starting.post("/api/agent/v1/events", {"events": [{**END, "job_id": str(starting.job.pk)},
                                                          {**END, "attempt": "one"}]}, format="json")
    assert r.status_code == 400, r.content
    assert "attempt" in str(r.json()["error"]["fields"])
    starting.job.refresh_from_db()
    assert starting.job.state == "starting"  # nothing of the batch applied
