"""allowed_project_ids, the tenancy choke point, selects exactly what guardian's
get_objects_for_user selects with the options the portal always used (issue 14 replaced the call
with a direct query): user permissions only, no superuser bypass, no global permissions."""
import pytest
from django.contrib.auth.models import Group, Permission
from guardian.shortcuts import assign_perm, get_objects_for_user

from portal.tenancy.models import ACTION_PERMS, Project, allowed_project_ids


def guardian_ids(user, action):
    return set(get_objects_for_user(user, f"tenancy.{ACTION_PERMS[action]}", klass=Project, use_groups=False,
                                    with_superuser=False, accept_global_perms=False).values_list("pk", flat=True))


@pytest.mark.django_db
def test_every_persona_and_action_gets_guardians_answer(demo):
    from django.contrib.auth import get_user_model

    user_model = get_user_model()
    # What must not count: a group's permission, a global permission, being a superuser.
    loner = user_model.objects.create_user("loner", password="x")
    group = Group.objects.create(name="g")
    loner.groups.add(group)
    assign_perm("tenancy.submit_job", group, demo.nlp)
    loner.user_permissions.add(Permission.objects.get(codename="view_project"))
    root = user_model.objects.create_superuser("root", password="x")
    users = [*demo.users.values(), loner, root]
    seen = set()
    for user in users:
        for action in ACTION_PERMS:
            ours = set(allowed_project_ids(user, action).values_list("pk", flat=True))
            assert ours == guardian_ids(user, action), (user.username, action)
            seen.add(bool(ours))
    assert seen == {True, False}  # some hold permissions, some do not: the comparison says something
    assert not allowed_project_ids(loner, "submit").exists() and not allowed_project_ids(root, "view").exists()


def test_an_unknown_action_is_refused():
    with pytest.raises(ValueError):
        allowed_project_ids(None, "delete")
