"""Providers behind the one interface: libcloud (against libcloud's own dummy driver: no cloud is
reachable from CI), the local agents' processes, and the options each refuses."""
import os
import sys

import pytest
from django.conf import settings
from django.core.exceptions import ValidationError

from portal.autoscale import localnode
from portal.autoscale.models import NodePool, PoolNode
from portal.autoscale.providers import NodeRequest, ProviderError, provider_for
from tests.procs import wait_for

pytestmark = pytest.mark.django_db


def request(name, pool="gcp"):
    return NodeRequest(name=name, token="gpn_secret", pool=pool, gpu_model="H100-80GB", gpus=8, sandbox="docker")


def test_libcloud_creates_lists_and_deletes_through_the_driver():
    pool = NodePool.objects.create(name="gcp", provider="libcloud", provider_config={
        "driver": "dummy", "key": "0", "size": "Big", "image": "1"})
    provider = provider_for(pool)
    created = provider.create([request("gcp-1"), request("gcp-2")])
    assert all(isinstance(v, str) and v for v in created.values()), created
    for name, pid in created.items():
        PoolNode.objects.create(pool=pool, name=name, gpus=8, provider_id=pid, created_at="2026-01-01T00:00Z")
    # The dummy cloud names its nodes itself: ours are found by the ids it returned.
    assert provider.list() == created
    provider.delete("gcp-1", created["gcp-1"])
    assert provider.list() == {"gcp-2": created["gcp-2"]}
    provider.delete("gcp-1", created["gcp-1"])  # already gone: not an error
    nodes = provider.driver().list_nodes()
    assert str(created["gcp-1"]) not in {str(n.id) for n in nodes}


def test_libcloud_failures_come_back_per_node_not_as_exceptions():
    pool = NodePool.objects.create(name="gcp", provider="libcloud", provider_config={
        "driver": "dummy", "key": "0", "size": "Huge", "image": "1"})
    out = provider_for(pool).create([request("gcp-1")])
    assert isinstance(out["gcp-1"], ProviderError) and "size 'Huge' not offered" in str(out["gcp-1"])
    # A boot script needs a driver that takes user data; the dummy one does not, and says so.
    pool.provider_config = {"driver": "dummy", "key": "0", "size": "1", "image": "1",
                            "userdata": "#!/bin/sh\npython -m agents --portal {portal_url} --name {name}\n"}
    out = provider_for(pool).create([request("gcp-1")])
    assert isinstance(out["gcp-1"], ProviderError) and "ex_userdata" in str(out["gcp-1"])


@pytest.mark.parametrize("provider,config,field_message", [
    ("libcloud", {"driver": "no-such-cloud", "size": "1", "image": "1"}, "libcloud has no compute driver"),
    ("libcloud", {"driver": "dummy", "image": "1"}, "size: required"),
    ("command", {"resume_program": "/bin/true"}, "suspend_program: required"),
    ("nothing", {}, "provider: unknown"),
])
def test_a_pool_with_bad_provider_options_is_refused_with_the_reason(provider, config, field_message):
    pool = NodePool(name="p", provider=provider, provider_config=config)
    with pytest.raises(ValidationError) as err:
        pool.full_clean()
    assert field_message in str(err.value)


def test_a_pool_larger_at_min_than_max_is_refused():
    with pytest.raises(ValidationError) as err:
        NodePool(name="p", min_nodes=3, max_nodes=2).full_clean()
    assert "max_nodes" in err.value.message_dict


def test_local_nodes_are_agent_processes_with_the_token_kept_out_of_argv(tmp_path):
    """A local node whose portal does not answer keeps retrying its registration: running until stopped."""
    pid = localnode.start("loc-1", token="gpn_do_not_show", portal_url="http://127.0.0.1:9", gpus="sim:2xH100-80GB",
                          sandbox="process", root=tmp_path, broker=settings.CELERY_BROKER_URL, broker_folder="",
                          volumes_root="")
    try:
        assert localnode.running(tmp_path) == {"loc-1": pid}
        argv = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
        assert b"loc-1" in argv and not any(b"gpn_do_not_show" in a for a in argv)
        assert localnode.start("loc-1", token="x", portal_url="http://127.0.0.1:9", gpus="sim:2xH100-80GB",
                               root=tmp_path, broker=settings.CELERY_BROKER_URL, broker_folder="",
                               volumes_root="") == pid  # already running: the same one
        wait_for(lambda: "registration failed" in (tmp_path / "loc-1" / "agent.log").read_text(), 30,
                 "the agent to try its portal")
    finally:
        assert localnode.stop("loc-1", root=tmp_path)
    assert localnode.running(tmp_path) == {} and not os.path.exists(tmp_path / "loc-1" / "pid")
    assert not localnode.stop("loc-1", root=tmp_path)  # gone already


def test_localnode_command_line_lists_what_runs(tmp_path):
    import subprocess

    out = subprocess.run([sys.executable, "-m", "portal.autoscale.localnode", "list", "--root", str(tmp_path)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout == ""
