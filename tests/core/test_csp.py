"""Content-Security-Policy on every response (issue 12, M6), and templates that need no more.

The browser side (no violation while people use the pages) is checked by tests/e2e, whose
`login` fixture fails a test on any CSP report in Chromium's console.
"""
import re
from pathlib import Path

import pytest
from django.conf import settings

TEMPLATES = Path(settings.BASE_DIR) / "templates"


def _policy(response) -> dict[str, list[str]]:
    header = response["Content-Security-Policy"]
    return {d.split()[0]: d.split()[1:] for d in header.split(";") if d.strip()}


@pytest.mark.parametrize("who,url", [
    (None, "/login/"), ("alice", "/"), ("alice", "/jobs/"), ("alice", "/jobs/new/"), ("alice", "/tokens/"),
    ("alice", "/api/v1/me/"), (None, "/api/v1/me/"), ("alice", "/api/v1/jobs/999999/"), ("alice", "/no-such-page/"),
    (None, "/api/docs/"), (None, "/api/schema/"), ("admin", "/console/"), ("admin", "/admin/"),
])
def test_every_response_carries_the_policy(demo, client, who, url):
    if who:
        client.force_login(demo.users[who])
    policy = _policy(client.get(url))
    assert policy["script-src"] == ["'self'"]
    assert policy["object-src"] == ["'none'"] and policy["base-uri"] == ["'self'"]
    assert policy["frame-ancestors"] == ["'none'"] and policy["default-src"] == ["'self'"]


INLINE_SCRIPT = re.compile(r"<script(?![^>]*\bsrc=)[^>]*>", re.I)
HANDLER = re.compile(r"""\son[a-z]+\s*=|javascript:|hx-on|["']js:""", re.I)


def test_templates_hold_no_inline_script_or_handler():
    """script-src 'self' blocks inline code: any in our templates would break silently."""
    offenders = [f"{path.relative_to(TEMPLATES)}: {m.group(0)}" for path in TEMPLATES.rglob("*.html")
                 for m in [*INLINE_SCRIPT.finditer(path.read_text()), *HANDLER.finditer(path.read_text())]]
    assert not offenders


def test_api_docs_load_their_start_up_script_as_a_file(client):
    page = client.get("/api/docs/").content.decode()
    assert not INLINE_SCRIPT.search(page)
    script = re.search(r'<script src="([^"]*script=[^"]*)"', page)
    response = client.get(script.group(1).replace("&amp;", "&"))
    assert response.status_code == 200 and "SwaggerUIBundle" in response.content.decode()
