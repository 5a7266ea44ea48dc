"""gpuctl login: the token is checked before it is saved, in a file only its owner can read."""
import json
import stat


def test_login_saves_url_and_token_readable_by_the_owner_only(portal, gpuctl, monkeypatch):
    monkeypatch.delenv("GPUCTL_URL")
    monkeypatch.delenv("GPUCTL_TOKEN")
    result = gpuctl("login", "--url", portal.url + "/api/v1/", "--token", portal.token["bob"])
    assert result.exit_code == 0, result.stderr
    assert "as bob" in result.stdout
    assert stat.S_IMODE(portal.config.stat().st_mode) == 0o600
    assert stat.S_IMODE(portal.config.parent.stat().st_mode) == 0o700
    assert json.loads(portal.config.read_text()) == {"url": portal.url, "token": portal.token["bob"]}
    # Later commands read the file ...
    assert json.loads(gpuctl("whoami", "-o", "json").stdout)["username"] == "bob"
    # ... and the environment overrides it.
    monkeypatch.setenv("GPUCTL_TOKEN", portal.token["charlie"])
    assert json.loads(gpuctl("whoami", "-o", "json").stdout)["username"] == "charlie"


def test_login_prompts_for_the_token_without_echoing_it(portal, gpuctl, monkeypatch):
    monkeypatch.delenv("GPUCTL_TOKEN")
    result = gpuctl("login", "--url", portal.url, input=portal.token["alice"] + "\n")
    assert result.exit_code == 0, result.stderr
    assert portal.token["alice"] not in result.stdout
    assert json.loads(portal.config.read_text())["token"] == portal.token["alice"]


def test_login_with_a_bad_token_exits_3_and_saves_nothing(portal, gpuctl):
    result = gpuctl("login", "--url", portal.url, "--token", "gpp_not-a-real-token")
    assert result.exit_code == 3
    assert "Invalid, expired or revoked token." in result.stderr
    assert not portal.config.exists()


def test_login_replaces_an_existing_file_keeping_it_private(portal, gpuctl):
    portal.config.parent.mkdir(parents=True)
    portal.config.write_text("{}")
    portal.config.chmod(0o644)
    assert gpuctl("login", "--url", portal.url, "--token", portal.token["alice"]).exit_code == 0
    assert stat.S_IMODE(portal.config.stat().st_mode) == 0o600
