"""Browser end-to-end tests: Playwright for Python drives Debian's Chromium against
pytest-django's live_server (Debian's Chromium: see .ci/browser.sh).

Playwright's sync API keeps an event loop in the main thread, where Django refuses
database calls; tests therefore touch the database only in fixtures that run before
the browser starts, or through `in_db_thread`.
"""
import os
import socket
import threading
from pathlib import Path

import pytest
from django.db import connection

CHROMIUM = os.getenv("CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run", "--disable-dev-shm-usage"]
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"
PASSWORD = "demo-pass-123"  # settings.DEMO_PASSWORD, which seed_demo gives every demo user


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    setattr(item, f"rep_{report.when}", report)
    return report


def in_db_thread(fn, *args, **kwargs):
    """Run fn in a fresh thread (its own database connection, no event loop) and return its result."""
    box = {}

    def run():
        try:
            box["value"] = fn(*args, **kwargs)
        except BaseException as exc:  # re-raised in the test's thread
            box["error"] = exc
        finally:
            connection.close()

    thread = threading.Thread(target=run, name="e2e-db")
    thread.start()
    thread.join(60)
    if thread.is_alive():
        raise TimeoutError(f"{fn.__name__} did not finish within 60 s")
    if "error" in box:
        raise box["error"]
    return box.get("value")


@pytest.fixture
def e2e_settings(settings, live_server):
    settings.ALLOWED_HOSTS = ["localhost", "127.0.0.1"]
    return settings


@pytest.fixture
def chromium(demo, e2e_settings, monkeypatch):
    """A headless Chromium. Depends on `demo` so the database is ready before the event loop exists."""
    from playwright.sync_api import sync_playwright

    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: run .ci/browser.sh (apt-get install chromium)")
    # No agent runs here: commands for nodes go nowhere.
    monkeypatch.setattr("scheduler.dispatch._send", lambda *args, **kwargs: None)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield browser
        browser.close()


@pytest.fixture
def login(chromium, live_server, request):
    """login("alice") -> a Page logged in through the real form. On failure, every page is saved to
    test-artifacts/<test>-<n>.png and the path printed. Any Content-Security-Policy violation
    Chromium reports on any page fails the test: the policy must never break a page."""
    contexts = []
    csp_violations = []

    def make(username, javascript=True):
        context = chromium.new_context(viewport={"width": 1280, "height": 900}, base_url=live_server.url,
                                       java_script_enabled=javascript)
        context.set_default_timeout(15_000)
        context.on("console", lambda msg: csp_violations.append(msg.text)
                   if "Content Security Policy" in msg.text else None)
        contexts.append(context)
        page = context.new_page()
        page.goto("/login/")
        page.get_by_label("Username").fill(username)
        page.get_by_label("Password").fill(PASSWORD)
        page.get_by_role("button", name="Log in").click()
        page.wait_for_url(f"{live_server.url}/")  # the dashboard: the session cookie is set
        return page

    yield make
    failed = getattr(request.node, "rep_call", None) is not None and request.node.rep_call.failed
    if failed:
        ARTIFACTS.mkdir(exist_ok=True)
        for n, context in enumerate(contexts):
            for m, page in enumerate(context.pages):
                path = ARTIFACTS / f"{request.node.name}-{n}{m}.png"
                try:
                    page.screenshot(path=str(path), full_page=True)
                    print(f"\nscreenshot of the failed test: {path}")
                except Exception as exc:  # a crashed page must not hide the real failure
                    print(f"\nno screenshot ({exc})")
    for context in contexts:
        context.close()
    assert not csp_violations, f"Content-Security-Policy violations: {csp_violations}"


def shot(page, name: str) -> Path:
    """Keep a screenshot of a page the test reached (test-artifacts/e2e/<name>.png), for people to look at."""
    folder = ARTIFACTS / "e2e"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    return path


@pytest.fixture(scope="module")
def portal_asgi():
    """uvicorn serving portal.asgi (Django and the session proxy) on a free port, in a thread."""
    import uvicorn

    from portal.asgi import application
    from tests.procs import wait_for

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(application, log_level="warning", lifespan="on", ws_max_size=1 << 20))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    wait_for(lambda: server.started, 30, "uvicorn to start")
    yield f"http://localhost:{port}"
    server.should_exit = True
    thread.join(15)
    sock.close()
