from datetime import timedelta
from io import StringIO

import pytest
from django.core.management import CommandError, call_command
from django.db import connection
from django.utils import timezone

from portal.accounts import tokens
from portal.accounts.models import ApiToken
from portal.core.errors import ServiceError
from tests.conftest import make_token


def test_database_never_holds_a_usable_token(demo, api):
    r = api("alice").post("/api/v1/tokens/", data={"name": "laptop", "scopes": ["read"]}, format="json")
    assert r.status_code == 201
    secret = r.json()["token"]
    assert secret.startswith("gpp_") and tokens.looks_valid(secret)
    # Scan every text column of the token table: the secret is nowhere, only its digest.
    with connection.cursor() as cursor:
        cursor.execute("SELECT * FROM accounts_apitoken")
        rows = cursor.fetchall()
    flat = " ".join(str(v) for row in rows for v in row)
    assert secret not in flat
    assert secret[12:] not in flat
    row = ApiToken.objects.get(pk=r.json()["id"])
    assert row.digest == tokens.digest(secret) and row.prefix == secret[:12]
    # The digest itself does not authenticate.
    assert api(token=row.digest).get("/api/v1/me/").status_code == 401
    # The secret is shown once: list and detail never carry it.
    listed = api("alice").get("/api/v1/tokens/").json()["results"]
    assert all("token" not in t for t in listed)
    assert "token" not in api("alice").get(f"/api/v1/tokens/{row.pk}/").json()


def test_token_authenticates_and_records_last_use(demo, api):
    secret = make_token(demo.users["alice"], ["read"])
    r = api(token=secret).get("/api/v1/me/")
    assert r.status_code == 200
    assert r.json()["username"] == "alice" and r.json()["token"]["scopes"] == ["read"]
    assert ApiToken.objects.get(prefix=secret[:12]).last_used_at is not None


@pytest.mark.parametrize("mutate", ["expired", "revoked", "inactive_user", "garbled", "node_token"])
def test_unusable_tokens_get_401(demo, api, mutate):
    secret = make_token(demo.users["alice"], ["read"])
    token = ApiToken.objects.get(prefix=secret[:12])
    if mutate == "expired":
        ApiToken.objects.filter(pk=token.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
    elif mutate == "revoked":
        assert api("alice").delete(f"/api/v1/tokens/{token.pk}/").status_code == 204
    elif mutate == "inactive_user":
        demo.users["alice"].is_active = False
        demo.users["alice"].save()
    elif mutate == "garbled":
        secret = secret[:-1] + ("A" if secret[-1] != "A" else "B")
    elif mutate == "node_token":
        secret = "gpn_" + secret[4:]
    r = api(token=secret).get("/api/v1/projects/")
    assert r.status_code == 401
    assert r.json()["error"]["code"] == "authentication_failed"
    assert r["WWW-Authenticate"] == "Bearer"


def test_token_in_query_string_is_ignored(demo, api):
    secret = make_token(demo.users["alice"], ["read"])
    assert api().get(f"/api/v1/me/?token={secret}").status_code == 401
    assert api().get(f"/api/v1/me/?access_token={secret}").status_code == 401


def test_revoke_twice_is_a_conflict(demo, api):
    secret = make_token(demo.users["alice"], ["read"])
    pk = ApiToken.objects.get(prefix=secret[:12]).pk
    assert api("alice").delete(f"/api/v1/tokens/{pk}/").status_code == 204
    assert api("alice").delete(f"/api/v1/tokens/{pk}/").status_code == 409
    listed = api("alice").get("/api/v1/tokens/").json()["results"]
    assert listed[0]["active"] is False and listed[0]["revoked_at"]


def test_token_cannot_mint_a_wider_token(demo, api):
    secret = make_token(demo.users["alice"], ["read", "admin"], project=demo.vision)
    client = api(token=secret)
    r = client.post("/api/v1/tokens/", data={"name": "x", "scopes": ["submit"], "project": "vision"}, format="json")
    assert r.status_code == 403 and "scopes" in r.json()["error"]["fields"]
    r = client.post("/api/v1/tokens/", data={"name": "x", "scopes": ["read"]}, format="json")
    assert r.status_code == 403 and "project" in r.json()["error"]["fields"]
    r = client.post("/api/v1/tokens/", data={"name": "x", "scopes": ["read"], "project": "vision"}, format="json")
    assert r.status_code == 201


@pytest.mark.clock
def test_expiry_is_capped(demo, settings, clock):
    settings.TOKEN_MAX_EXPIRY_DAYS = 30
    settings.TOKEN_DEFAULT_EXPIRY_DAYS = 20
    with pytest.raises(ServiceError, match="between 1 and 30"):
        make_token(demo.users["alice"], ["read"], expires_days=31)
    make_token(demo.users["alice"], ["read"])
    token = ApiToken.objects.filter(user=demo.users["alice"]).latest("id")
    assert token.expires_at == clock() + timedelta(days=settings.TOKEN_DEFAULT_EXPIRY_DAYS)


def test_issue_token_command(demo, api):
    out = StringIO()
    call_command("issue_token", "bob", "--scopes", "read", "--project", "vision", "--expires-days", "7", stdout=out)
    secret = out.getvalue().strip()
    assert secret.startswith("gpp_")
    me = api(token=secret).get("/api/v1/me/").json()
    assert me["username"] == "bob" and me["token"]["project"] == "vision" and me["token"]["scopes"] == ["read"]
    assert api(token=secret).patch("/api/v1/projects/vision/", data={"name": "x"}, format="json").status_code == 403


@pytest.mark.parametrize("args,message", [
    (["nobody"], "No user named 'nobody'"),
    (["bob", "--project", "nlp"], "--project"),
    (["bob", "--scopes", "root"], "Unknown scope"),
    (["bob", "--expires-days", "0"], "--expires-days"),
])
def test_issue_token_command_errors(demo, args, message):
    with pytest.raises(CommandError, match=message):
        call_command("issue_token", *args, stdout=StringIO())
    assert not ApiToken.objects.exists()


def _mint(client, **body):
    return client.post("/api/v1/tokens/", data={"name": "child", "scopes": ["read"], **body}, format="json")


def test_minted_token_cannot_outlive_its_parent(demo, api):
    """M1: a 1-day token created a 365-day token."""
    parent = make_token(demo.users["alice"], ["read", "submit", "admin"], expires_days=1)
    parent_row = ApiToken.objects.filter(user=demo.users["alice"]).latest("id")
    r = _mint(api(token=parent), scopes=["read", "submit", "admin"], expires_days=365)
    assert r.status_code == 400 and "expires_days" in r.json()["error"]["fields"]
    # Without expires_days the default is cut to the parent's expiry.
    r = _mint(api(token=parent))
    assert r.status_code == 201
    child = ApiToken.objects.get(pk=r.json()["id"])
    assert child.expires_at == parent_row.expires_at and child.parent_id == parent_row.pk
    assert r.json()["parent"] == parent_row.pk
    # A session (no parent token) still gets the full default.
    r = _mint(api("alice"))
    assert ApiToken.objects.get(pk=r.json()["id"]).expires_at > parent_row.expires_at + timedelta(days=10)


def test_revoking_a_token_kills_the_tokens_minted_with_it(demo, api):
    parent = make_token(demo.users["alice"], ["read", "admin"])
    parent_row = ApiToken.objects.filter(user=demo.users["alice"]).latest("id")
    child = _mint(api(token=parent), scopes=["read", "admin"]).json()["token"]
    grandchild = _mint(api(token=child)).json()["token"]
    assert api(token=grandchild).get("/api/v1/me/").status_code == 200
    assert api("alice").delete(f"/api/v1/tokens/{parent_row.pk}/").status_code == 204
    for secret in (parent, child, grandchild):
        assert api(token=secret).get("/api/v1/me/").status_code == 401
    listed = {t["name"]: t["active"] for t in api("alice").get("/api/v1/tokens/").json()["results"]}
    assert listed["child"] is False


@pytest.mark.parametrize("kill", ["revoked", "expired"])
def test_child_dies_with_a_parent_made_unusable_outside_the_service(demo, api, kill):
    """Revoked in the admin, or simply expired: the check at authentication holds."""
    parent = make_token(demo.users["alice"], ["read", "admin"])
    parent_row = ApiToken.objects.filter(user=demo.users["alice"]).latest("id")
    child = _mint(api(token=parent), scopes=["read", "admin"]).json()["token"]
    grandchild = _mint(api(token=child)).json()["token"]
    past = timezone.now() - timedelta(seconds=1)
    ApiToken.objects.filter(pk=parent_row.pk).update(**{"revoked_at" if kill == "revoked" else "expires_at": past})
    assert api(token=child).get("/api/v1/me/").status_code == 401
    assert api(token=grandchild).get("/api/v1/me/").status_code == 401


def test_token_lineage_is_bounded(demo, api):
    """Authentication checks every ancestor: a chain is kept short."""
    from portal.accounts.services import MAX_TOKEN_GENERATIONS

    secret = make_token(demo.users["alice"], ["read", "admin"])
    for _ in range(MAX_TOKEN_GENERATIONS - 1):
        r = _mint(api(token=secret), scopes=["read", "admin"])
        assert r.status_code == 201
        secret = r.json()["token"]
    r = _mint(api(token=secret), scopes=["read", "admin"])
    assert r.status_code == 403 and "generations" in r.json()["error"]["message"]
    assert api(token=secret).get("/api/v1/me/").status_code == 200


def test_the_plain_sql_token_read_equals_the_orms(demo, api):
    """token_authenticate reads the token and its user in plain SQL (issue 14): every field, the
    JSON scopes and the times included, is what the ORM reads, and the project loads on demand."""
    from django.forms.models import model_to_dict

    from portal.accounts.services import token_authenticate

    r = api("alice").post("/api/v1/tokens/", data={"name": "ci", "scopes": ["read", "submit"], "project": "vision"},
                          format="json")
    assert r.status_code == 201, r.content
    secret = r.json()["token"]
    token = token_authenticate(secret)
    orm = ApiToken.objects.select_related("user").get(pk=r.json()["id"])
    assert model_to_dict(token) == model_to_dict(orm) and token.scopes == ["read", "submit"]
    assert token.created_at == orm.created_at and token.expires_at == orm.expires_at
    assert model_to_dict(token.user) == model_to_dict(orm.user) and token.user.last_login == orm.user.last_login
    assert token.project.slug == "vision" and token.parent is None
