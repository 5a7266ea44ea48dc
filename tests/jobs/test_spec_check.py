"""The submit checks a spec with one JobSpecSerializer a thread (portal/jobs/services._checked_spec):
it must take and refuse exactly what a fresh serializer with the submit's project takes and refuses,
whatever was checked before it and for whichever project."""
import pytest

from portal.core.errors import InvalidInput, check_valid
from portal.jobs.services import _checked_spec
from portal.jobs.spec import JobSpecSerializer
from portal.tenancy.models import Quota

IMAGE = "gpuportal/busybox:latest"

BODIES = [
    {"project": "vision", "image": IMAGE, "command": ["true"]},
    {"project": "vision", "name": "n", "image": IMAGE, "command": ["python", "t.py"], "env": {"A": "1"},
     "resources": {"gpus": 0, "cpus": 2, "memory_mb": 512}, "time_limit": "1h", "priority": "high"},
    {"project": "vision", "image": IMAGE, "command": ["true"], "network": True},  # per project
    {"project": "vision", "image": IMAGE, "command": ["true"], "time_limit": 7200},  # per project
    {"project": "vision", "image": IMAGE, "command": ["true"], "checkpoint": {"signal": "SIGTERM", "grace_s": 30}},
    {"project": "vision", "image": "nope/evil:1", "command": ["true"]},
    {"project": "vision", "image": IMAGE, "command": [], "bogus": 1},
    {"project": "vision", "image": IMAGE, "command": "true", "resources": {"gpus": -1}, "env": {"": "x"}},
    {"project": "vision", "image": IMAGE, "command": ["true"], "depends_on": ["x"], "priority": "urgent"},
]


def fresh(body, project):
    try:
        return "ok", check_valid(JobSpecSerializer(data=body, context={"project": project}))
    except InvalidInput as exc:
        return "refused", exc.as_fields()


def shared(body, project):
    try:
        return "ok", _checked_spec(body, project)
    except InvalidInput as exc:
        return "refused", exc.as_fields()


@pytest.mark.django_db
def test_the_shared_checker_answers_as_a_fresh_serializer_for_each_project(demo):
    Quota.objects.filter(project=demo.vision).update(network_allowed=True, max_time_limit_s=86400)
    Quota.objects.filter(project=demo.nlp).update(network_allowed=False, max_time_limit_s=3600)
    vision, nlp = (type(demo.vision).objects.select_related("quota").get(pk=p.pk) for p in (demo.vision, demo.nlp))
    outcomes = set()
    for _ in range(2):  # every body after every other, for both projects in turn
        for body in BODIES:
            for project in (vision, nlp, vision):
                expected = fresh(body, project)
                assert shared(body, project) == expected, (body, project.slug)
                outcomes.add((BODIES.index(body), project.slug, expected[0]))
    # The projects' rules are each submit's own: the same body is taken by one and refused by the other.
    assert (2, "vision", "ok") in outcomes and (2, "nlp", "refused") in outcomes
    assert (3, "vision", "ok") in outcomes and (3, "nlp", "refused") in outcomes
    assert {o for _, _, o in outcomes} == {"ok", "refused"}


@pytest.mark.django_db
def test_what_one_check_gives_is_not_what_the_next_one_gets(demo):
    project = type(demo.vision).objects.select_related("quota").get(pk=demo.vision.pk)
    body = {"project": "vision", "image": IMAGE, "command": ["true"]}
    first = _checked_spec(body, project)
    first["env"]["LEAK"] = "1"
    first["depends_on"].append(99)
    first["volumes"].append({"name": "x"})
    second = _checked_spec(body, project)
    assert second["env"] == {} and second["depends_on"] == [] and second["volumes"] == []
    assert second == fresh(body, project)[1]
