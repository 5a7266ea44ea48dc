"""gunicorn settings for the portal (systemd/gpuportal-web.service runs
`gunicorn -c /opt/gpuportal/deploy/gunicorn.conf.py portal.wsgi:application`).

nginx in front (deploy/nginx/gpuportal.conf) terminates TLS, serves /static/ and buffers slow
clients, so plain sync workers suffice: requests are short (pages, API, agent reports), long
waits happen in the browser (htmx polling) and the CLI (polling), never in a worker.
Every value can be changed from the environment file without editing this one.
"""
import multiprocessing
import os

# A Unix socket only nginx (group www-data) can reach; GUNICORN_BIND=127.0.0.1:8000 for TCP.
bind = os.getenv("GUNICORN_BIND", "unix:/run/gpuportal/gunicorn.sock")
umask = 0o007
# gunicornc's control socket beside the main one (not in the service user's home), owner only.
control_socket = os.getenv("GUNICORN_CONTROL_SOCKET") or (
    bind[len("unix:"):].rsplit("/", 1)[0] + "/gunicorn.ctl" if bind.startswith("unix:") else "/run/gpuportal/gunicorn.ctl")
workers = int(os.getenv("GUNICORN_WORKERS", str(min(2 * multiprocessing.cpu_count() + 1, 9))))
threads = int(os.getenv("GUNICORN_THREADS", "2"))
# Above the agent client's 10 s and the portal's database timeouts, below nginx's proxy timeout.
timeout = int(os.getenv("GUNICORN_TIMEOUT", "60"))
graceful_timeout = 30
keepalive = 5
# A worker is replaced after this many requests: bounded memory growth without a restart.
max_requests = 2000
max_requests_jitter = 200
# Trust X-Forwarded-* only from the proxy on this machine (the portal also needs USE_X_FORWARDED_PROTO=1).
forwarded_allow_ips = os.getenv("GUNICORN_FORWARDED_ALLOW_IPS", "127.0.0.1,::1")
accesslog = "-"  # journald keeps it
errorlog = "-"
loglevel = os.getenv("GUNICORN_LOG_LEVEL", "info")
access_log_format = '%({x-forwarded-for}i)s "%(r)s" %(s)s %(B)s %(M)sms'
proc_name = "gpuportal-web"
# The application (Django, every URL and view) is loaded in the master *before* it listens, and the
# workers fork from it ready to answer. So while gunicorn (re)starts nothing listens at all: nginx
# cannot connect and answers the portal's outage (503, X-Gpuportal-Outage: web; deploy/nginx), and
# an agent reaching gunicorn directly is refused, which it also takes for the portal's outage: its
# jobs run on through a restart of every portal process (docs/reliability.md, "Restarting the portal").
# Without it the master listens at once and requests queue unanswered while workers load for
# seconds, which an agent cannot tell from a partition. New code needs a restart (`systemctl restart
# gpuportal-web`): a reload (HUP) forks new workers from the code already loaded.
preload_app = True


def on_starting(server):
    """Preloaded: import the URLconf (every view module) in the master too, so a fresh worker's first
    request does not; close any database connection the imports opened, not to share it with forks;
    and freeze what is loaded so far out of the garbage collector's sight (gc.freeze, as CPython's
    docs advise before forking): a worker's full collections then walk only what it made itself, not
    the few hundred thousand objects of Django and the portal, and do not write to (so copy) the
    pages it shares with the master."""
    if not server.cfg.preload_app:
        return
    import gc

    from django.db import connections
    from django.urls import get_resolver

    get_resolver().url_patterns
    connections.close_all()
    gc.collect()
    gc.freeze()
