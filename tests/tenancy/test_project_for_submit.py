"""project_for_submit, the submit's project read, gives the ORM's answer (for_user "view" with the
quota and the role's submit right) for every persona, project and token restriction: on PostgreSQL it
is plain SQL written beside the tenancy choke point, not built from it."""
import pytest
from django.contrib.auth.models import Group, Permission
from django.db.models import Exists, OuterRef
from django.forms.models import model_to_dict
from guardian.shortcuts import assign_perm

from portal.tenancy.models import Project, Quota, allowed_project_ids
from portal.tenancy.selectors import project_for_submit


def orm_answer(user, slug, project_id):
    return Project.objects.for_user(user, "view", project_id=project_id).select_related("quota") \
        .filter(slug=slug).annotate(
            may_submit=Exists(allowed_project_ids(user, "submit").filter(pk=OuterRef("pk")))).first()


def described(project):
    if project is None:
        return None
    try:
        quota = model_to_dict(project.quota)
    except Quota.DoesNotExist:
        quota = None
    return model_to_dict(project), quota, project.may_submit


@pytest.mark.django_db
def test_every_persona_project_and_restriction_gets_the_orms_answer(demo, django_assert_num_queries):
    from django.contrib.auth import get_user_model

    user_model = get_user_model()
    # What must not count: a group's permission, a global permission, being a superuser.
    loner = user_model.objects.create_user("loner", password="x")
    group = Group.objects.create(name="g")
    loner.groups.add(group)
    assign_perm("tenancy.submit_job", group, demo.nlp)
    assign_perm("tenancy.view_project", group, demo.nlp)
    loner.user_permissions.add(Permission.objects.get(codename="submit_job"))
    root = user_model.objects.create_superuser("root", password="x")
    gone = user_model.objects.create_user("gone", password="x", is_active=False)
    bare = Project.objects.create(organization=demo.vision.organization, slug="bare", name="Bare")  # no quota
    for user in [*demo.users.values(), loner, root, gone]:
        if user.username in demo.users and user.is_active:
            assign_perm("tenancy.view_project", user, bare)
    answers = set()
    for user in [*demo.users.values(), loner, root, gone]:
        for slug in ("vision", "nlp", "bare", "nowhere"):
            for project_id in (None, demo.vision.pk, demo.nlp.pk, bare.pk):
                expected = orm_answer(user, slug, project_id)
                with django_assert_num_queries(0 if not user.is_active else 1):
                    got = project_for_submit(user, slug, project_id=project_id)
                assert described(got) == described(expected), (user.username, slug, project_id)
                answers.add(None if got is None else got.may_submit)
    assert answers == {None, True, False}  # seen, seen with the right to submit, and not: the comparison says something
