"""ASGI entry point (uvicorn portal.asgi:application): the session proxy and the rest of the portal.

/sessions/... (HTTP and WebSockets) goes to the session proxy (portal/interactive/proxy.py);
every other HTTP request goes to Django, the same views gunicorn serves through portal.wsgi.
Production runs gunicorn for the portal and this under uvicorn for /sessions/ only, nginx routing
between them (docs/deploy.md); `make run` serves everything from here.
"""
import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")
django_app = get_asgi_application()

from portal.interactive.proxy import app as session_app, close as session_close  # noqa: E402  (Django first)


async def application(scope, receive, send):
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await session_close()
                await send({"type": "lifespan.shutdown.complete"})
                return
    if scope["path"].startswith("/sessions/"):
        return await session_app(scope, receive, send)
    if scope["type"] == "websocket":  # the portal's own pages use none
        await send({"type": "websocket.close", "code": 4404})
        return
    return await django_app(scope, receive, send)
