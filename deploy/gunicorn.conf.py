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
