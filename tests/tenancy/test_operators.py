"""One staff check for the site's operators' actions (portal.core.services.require_operator):
site staff and the portal acting on its own (a task, manage.py) may; a project owner may not."""
from datetime import date
from decimal import Decimal

import pytest

from portal.billing.services import ratecard_set
from portal.core.context import Actor
from portal.core.errors import Forbidden
from portal.nodes.services import node_add
from portal.tenancy.services import organization_create, quota_update

ACTIONS = {
    "create an organization": lambda actor, demo: organization_create(actor=actor, slug="initech", name="Initech"),
    "change a quota": lambda actor, demo: quota_update(actor=actor, project=demo.vision, max_gpus=Decimal(30)),
    "add a node": lambda actor, demo: node_add(actor=actor, name="gpu-09"),
    "set a price": lambda actor, demo: ratecard_set(actor=actor, gpu_model="H100-80GB", price_per_gpu_hour=Decimal(2),
                                                   effective_from=date(2026, 1, 1)),
}


@pytest.mark.parametrize("action", ACTIONS)
@pytest.mark.parametrize("who", ["admin", "manage.py"])
def test_staff_and_the_portal_itself_operate_the_site(demo, action, who):
    actor = Actor(user=demo.users["admin"]) if who == "admin" else Actor(user=None, label=who)
    assert ACTIONS[action](actor, demo) is not None


@pytest.mark.parametrize("action", ACTIONS)
def test_a_project_owner_is_refused_with_a_403(demo, action):
    with pytest.raises(Forbidden, match="Only site staff") as refused:
        ACTIONS[action](Actor(user=demo.users["alice"]), demo)
    assert refused.value.status == 403
