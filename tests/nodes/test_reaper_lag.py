"""The portal's own overload is not node death: when it hears every node late (heartbeats queued
behind a busy portal), the reaper moves every deadline by that lag instead of marking the late
ones down, while a dead node among nodes heard on time is still down within NODE_TIMEOUT_S plus
one reaper period; the brake lets go NODE_TIMEOUT_S after the portal catches up."""
from datetime import timedelta

import pytest

from portal.core.context import Actor
from portal.core.models import AuditEvent
from portal.nodes.models import Node, ReaperState
from portal.jobs.node_effects import nodes_reap
from portal.nodes.services import ingest_lag, node_add

pytestmark = pytest.mark.clock


@pytest.fixture
def fleet(demo):
    admin = Actor(user=demo.users["admin"])
    names = [f"f{i:02d}" for i in range(20)]
    for name in names:
        node_add(actor=admin, name=name, gpus="1xH100-80GB")
    return names


def heard(clock, ages: dict):
    """Each node named was last heard `age` seconds ago."""
    for name, age in ages.items():
        Node.objects.filter(name=name).update(last_heartbeat_at=clock() - timedelta(seconds=age))


def paced(names, period, offset=0.0):
    """A fleet of agents that each heartbeat once per `period`, in phases spread over it."""
    return {name: (offset + period * i / len(names)) % period for i, name in enumerate(names)}


def reaped():
    return set(Node.objects.filter(state="down").values_list("name", flat=True))


def test_the_lag_is_read_from_how_long_the_typical_node_is_silent(settings, clock):
    now = clock()
    on_time = [now - timedelta(seconds=s) for s in (0.5, 1.5, 2.5, 3.5, 4.5)]
    assert ingest_lag(now, on_time) == 0.0
    late = [now - timedelta(seconds=s) for s in range(0, 30, 3)]  # a period of 30 s: 25 s late
    assert ingest_lag(now, late) == pytest.approx(2 * 12 - settings.NODE_HEARTBEAT_INTERVAL_S)
    # A dead node, however long silent, does not move the median of the others.
    assert ingest_lag(now, on_time + [now - timedelta(hours=1)]) < settings.NODE_HEARTBEAT_INTERVAL_S
    assert ingest_lag(now, [now - timedelta(hours=1)] * 2) == 0.0  # too few to tell
    # A fleet beating in step (every agent started at once), heard on time: just before its next
    # beat every node is an interval and a bit silent, which is not lag.
    in_step = [now - timedelta(seconds=settings.NODE_HEARTBEAT_INTERVAL_S + 0.3)] * 10
    assert ingest_lag(now, in_step) == pytest.approx(0.3)
    # ...and heard 20 s late, it is.
    assert ingest_lag(now, [now - timedelta(seconds=settings.NODE_HEARTBEAT_INTERVAL_S + 20)] * 10) == 20


def test_many_nodes_heard_late_together_are_not_reaped_while_the_portal_lags(fleet, settings, clock):
    nodes_reap()
    # Overloaded: every agent waits ~25 s for its answer, so each is heard every 30 s; at any
    # moment a third of the fleet is past NODE_TIMEOUT_S (too few for the mass-failure brake).
    for step in range(12):  # a minute of reaper runs
        ages = paced(fleet, 30.0, offset=step * settings.NODE_REAP_INTERVAL_S)
        heard(clock, ages)
        assert sum(age > settings.NODE_TIMEOUT_S for age in ages.values()) >= 6
        result = nodes_reap()
        assert result["down"] == 0 and "suspected_portal_failure" not in result, result
        assert result["ingest_lag_s"] > settings.NODE_HEARTBEAT_INTERVAL_S
        clock.advance(seconds=settings.NODE_REAP_INTERVAL_S)
    assert reaped() == set()
    behind = AuditEvent.objects.filter(action="reaper.portal_behind")
    assert behind.count() == 1 and behind.get().data["ingest_lag_s"] > settings.NODE_HEARTBEAT_INTERVAL_S


def test_a_node_dead_while_the_portal_lags_is_still_found_later(fleet, settings, clock):
    nodes_reap()
    dead_for = 0.0
    for step in range(20):
        ages = paced(fleet[1:], 30.0, offset=step * settings.NODE_REAP_INTERVAL_S)
        heard(clock, {**ages, fleet[0]: dead_for})
        result = nodes_reap()
        if reaped():
            break
        clock.advance(seconds=settings.NODE_REAP_INTERVAL_S)
        dead_for += settings.NODE_REAP_INTERVAL_S
    assert reaped() == {fleet[0]}
    # Later than NODE_TIMEOUT_S by about the lag (25 s), not held for as long as the overload lasts.
    assert settings.NODE_TIMEOUT_S + 15 < dead_for <= settings.NODE_TIMEOUT_S + 35 + settings.NODE_REAP_INTERVAL_S
    assert result["down"] == 1


def test_one_dead_node_among_fresh_ones_is_reaped_in_time(fleet, settings, clock):
    nodes_reap()
    dead_for = 0.0
    for step in range(10):
        heard(clock, {**paced(fleet[1:], settings.NODE_HEARTBEAT_INTERVAL_S + 0.2, offset=step * 1.3),
                      fleet[0]: dead_for})
        result = nodes_reap()
        assert "ingest_lag_s" not in result
        if reaped():
            break
        clock.advance(seconds=settings.NODE_REAP_INTERVAL_S)
        dead_for += settings.NODE_REAP_INTERVAL_S
    assert reaped() == {fleet[0]}
    assert dead_for <= settings.NODE_TIMEOUT_S + settings.NODE_REAP_INTERVAL_S <= 30
    assert not AuditEvent.objects.filter(action__startswith="reaper.").exists()


def test_the_brake_lets_go_once_the_portal_catches_up(fleet, settings, clock):
    nodes_reap()
    heard(clock, paced(fleet, 30.0))
    assert nodes_reap()["ingest_lag_s"] > settings.NODE_HEARTBEAT_INTERVAL_S
    # The portal catches up: the queued heartbeats are heard, every node but one answers on time.
    clock.advance(seconds=settings.NODE_REAP_INTERVAL_S)
    dead = fleet[0]
    dead_since = clock() - timedelta(seconds=30)  # its last heartbeat was heard in the lag
    caught_up_after = None
    for step in range(12):
        heard(clock, paced(fleet[1:], settings.NODE_HEARTBEAT_INTERVAL_S, offset=step * 1.3))
        Node.objects.filter(name=dead).update(last_heartbeat_at=dead_since)
        result = nodes_reap()
        if AuditEvent.objects.filter(action="reaper.portal_caught_up").exists() and caught_up_after is None:
            caught_up_after = step * settings.NODE_REAP_INTERVAL_S
        if reaped():
            break
        assert result["down"] == 0
        clock.advance(seconds=settings.NODE_REAP_INTERVAL_S)
    # Held NODE_TIMEOUT_S past the last late reading (the queued heartbeats still arriving), then
    # deadlines are NODE_TIMEOUT_S again and the dead node, long past it, goes down.
    assert caught_up_after is not None and settings.NODE_TIMEOUT_S - settings.NODE_REAP_INTERVAL_S <= caught_up_after
    assert caught_up_after <= settings.NODE_TIMEOUT_S + settings.NODE_REAP_INTERVAL_S
    assert reaped() == {dead}
    state = ReaperState.objects.get(pk=1)
    assert state.ingest_lag_s == 0.0 and state.ingest_lag_at is None
    assert AuditEvent.objects.get(action="reaper.portal_caught_up").data["held_lag_s"] > 5
