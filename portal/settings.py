"""gpuportal settings: everything comes from environment variables.

With nothing set the portal runs on the embedded default (SQLite, a filesystem
Celery broker under var/). `DATABASE_URL` and `CELERY_BROKER_URL` switch to
PostgreSQL and Redis. A bad value stops the start with a message naming the
variable, never a half-configured server.
"""
import os
import secrets
from datetime import timedelta
from pathlib import Path

import dj_database_url
from django.core.exceptions import ImproperlyConfigured

BASE_DIR = Path(__file__).resolve().parent.parent
VAR_DIR = Path(os.getenv("GPUPORTAL_VAR_DIR", BASE_DIR / "var"))


def _read_dotenv(path: Path) -> None:
    """Load KEY=VALUE lines from .env without overriding the real environment."""
    if not path.is_file():
        return
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#") or "=" not in line:
            continue
        key, _, value = line.partition("=")
        os.environ.setdefault(key.strip(), value.strip().strip("'\""))


_read_dotenv(BASE_DIR / ".env")


def env_str(name: str, default: str = "") -> str:
    return os.getenv(name, default)


def env_bool(name: str, default: bool) -> bool:
    raw = os.getenv(name)
    if raw is None or raw == "":
        return default
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ImproperlyConfigured(f"{name}: expected 1/0/true/false, got {raw!r}")


def env_int(name: str, default: int, minimum: int | None = None) -> int:
    raw = os.getenv(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ImproperlyConfigured(f"{name}: expected an integer, got {raw!r}") from None
    if minimum is not None and value < minimum:
        raise ImproperlyConfigured(f"{name}: must be at least {minimum}, got {value}")
    return value


def env_float(name: str, default: float) -> float:
    raw = os.getenv(name)
    if raw is None or raw == "":
        return default
    try:
        return float(raw)
    except ValueError:
        raise ImproperlyConfigured(f"{name}: expected a number, got {raw!r}") from None


def env_list(name: str, default: list[str]) -> list[str]:
    raw = os.getenv(name)
    if raw is None:
        return default
    return [item.strip() for item in raw.split(",") if item.strip()]


DEBUG = env_bool("DEBUG", False)

SECRET_KEY = env_str("SECRET_KEY")
if not SECRET_KEY:
    if not DEBUG:
        raise ImproperlyConfigured(
            "SECRET_KEY: not set. Set SECRET_KEY to 50+ random characters, "
            "or DEBUG=1 for a development server."
        )
    # Development only: a stable random key kept under var/ so sessions survive restarts.
    key_file = VAR_DIR / "dev_secret_key"
    VAR_DIR.mkdir(parents=True, exist_ok=True)
    if not key_file.exists():
        key_file.write_text(secrets.token_urlsafe(60))
    SECRET_KEY = key_file.read_text().strip()
elif not DEBUG and (len(SECRET_KEY) < 50 or len(set(SECRET_KEY)) < 5):
    raise ImproperlyConfigured("SECRET_KEY: must be at least 50 characters with 5 distinct ones")

ALLOWED_HOSTS = env_list("ALLOWED_HOSTS", ["localhost", "127.0.0.1", "[::1]"] if DEBUG else [])
if not DEBUG and not ALLOWED_HOSTS:
    raise ImproperlyConfigured("ALLOWED_HOSTS: not set; list the host names the portal answers to")
CSRF_TRUSTED_ORIGINS = env_list("CSRF_TRUSTED_ORIGINS", [])

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "whitenoise.runserver_nostatic",
    "django.contrib.staticfiles",
    "rest_framework",
    "django_filters",
    "drf_spectacular",
    "drf_spectacular_sidecar",
    "guardian",
    "axes",
    "django_htmx",
    "portal.core",
    "portal.accounts",
    "portal.tenancy",
    "portal.nodes",
    "portal.jobs",
    "portal.billing",
    "portal.storage",
    "portal.metrics",
    "portal.console",
    "portal.interactive",
    "portal.autoscale",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "portal.core.request_checks.RefuseNulMiddleware",  # %00 in a URL, query or header: 404/400, not a 500
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django_htmx.middleware.HtmxMiddleware",  # request.htmx: pages answer htmx polls with fragments
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "portal.core.csp.ContentSecurityPolicyMiddleware",  # CONTENT_SECURITY_POLICY below
    # A database outage answers 503 + Retry-After, not 500 (portal/core/middleware.py).
    "portal.core.middleware.DatabaseOutageMiddleware",
    # Last, as django-axes asks: it turns a lockout into a response.
    "axes.middleware.AxesMiddleware",
]

ROOT_URLCONF = "portal.urls"
WSGI_APPLICATION = "portal.wsgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

# Database: embedded SQLite unless DATABASE_URL says otherwise.
_database_url = env_str("DATABASE_URL") or f"sqlite:///{VAR_DIR / 'gpuportal.sqlite3'}"
try:
    # Health checks: a persistent connection that died with a database restart is replaced at the
    # next request instead of failing it.
    DATABASES = {"default": dj_database_url.parse(_database_url, conn_max_age=env_int("DB_CONN_MAX_AGE", 60),
                                                  conn_health_checks=True)}
except Exception as exc:  # dj_database_url raises several types for a bad URL
    raise ImproperlyConfigured(f"DATABASE_URL: cannot parse {_database_url!r}: {exc}") from None
if DATABASES["default"]["ENGINE"] == "django.db.backends.postgresql":
    # Django's backend with a health check that reads the socket instead of asking the server
    # (portal/core/postgres/base.py): no SELECT 1 before each request's first statement.
    DATABASES["default"]["ENGINE"] = "portal.core.postgres"
    # Statements a connection runs often are prepared on the server, so PostgreSQL parses and plans
    # them once per connection instead of for every call (planning cost more than executing on the
    # agent API's and the submit's statements). This binds parameters on the server (Django's
    # server_side_binding). DB_PREPARE_THRESHOLD: the executions after which a statement is
    # prepared; 0 turns it off (behind a pooler in transaction mode, which cannot keep them).
    _prepare_after = env_int("DB_PREPARE_THRESHOLD", 2, minimum=0)
    if _prepare_after:
        DATABASES["default"].setdefault("OPTIONS", {}).update(
            server_side_binding=True, prepare_threshold=_prepare_after)
    # A database that does not answer fails a request within seconds (a 503, portal/core/middleware.py)
    # instead of holding it for the system's TCP timeout.
    DATABASES["default"].setdefault("OPTIONS", {}).setdefault(
        "connect_timeout", env_int("DB_CONNECT_TIMEOUT_S", 5, minimum=1))
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    VAR_DIR.mkdir(parents=True, exist_ok=True)
    # Several processes (web, worker, beat) share the file: wait for locks instead of failing.
    DATABASES["default"]["OPTIONS"] = {"timeout": 20, "transaction_mode": "IMMEDIATE"}
    DATABASES["default"]["CONN_MAX_AGE"] = 0
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

AUTHENTICATION_BACKENDS = [
    "axes.backends.AxesStandaloneBackend",
    "django.contrib.auth.backends.ModelBackend",
    "guardian.backends.ObjectPermissionBackend",
]
AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    {"NAME": "django.contrib.auth.password_validation.NumericPasswordValidator"},
]
if env_bool("GPUPORTAL_TEST_FAST_HASHER", False):
    # Tests only (pytest.ini sets it): a fast hasher so seeding personas costs nothing.
    PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
LOGIN_URL = "login"
LOGIN_REDIRECT_URL = "home"
LOGOUT_REDIRECT_URL = "login"

# Login throttling (django-axes): lock a username+IP after repeated failures.
AXES_FAILURE_LIMIT = env_int("LOGIN_FAILURE_LIMIT", 5, minimum=1)
AXES_COOLOFF_TIME = timedelta(minutes=env_int("LOGIN_COOLOFF_MINUTES", 15, minimum=1))
AXES_LOCKOUT_PARAMETERS = [["username", "ip_address"]]
AXES_RESET_ON_SUCCESS = True
AXES_LOCKOUT_TEMPLATE = "registration/locked_out.html"
AXES_VERBOSE = False

# Guardian: no anonymous user row; we never grant anonymous object permissions.
ANONYMOUS_USER_NAME = None
GUARDIAN_MONKEY_PATCH_USER = False

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
STATIC_ROOT = Path(env_str("STATIC_ROOT", str(VAR_DIR / "staticfiles")))
STATIC_ROOT.mkdir(parents=True, exist_ok=True)
STATICFILES_DIRS = [BASE_DIR / "static"]
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    "staticfiles": {"BACKEND": "whitenoise.storage.CompressedStaticFilesStorage"},
}
# Job artifacts (docs/storage.md): what jobs leave in /outputs, uploaded by the agents when they end.
# A folder under the var folder by default; ARTIFACTS_STORAGE=s3 keeps them in an S3-compatible bucket.
ARTIFACTS_STORAGE = env_str("ARTIFACTS_STORAGE", "local")
if ARTIFACTS_STORAGE == "s3":
    STORAGES["artifacts"] = {"BACKEND": "storages.backends.s3.S3Storage", "OPTIONS": {
        "bucket_name": env_str("ARTIFACTS_S3_BUCKET"),
        "endpoint_url": env_str("ARTIFACTS_S3_ENDPOINT_URL") or None,  # None: AWS itself
        "region_name": env_str("ARTIFACTS_S3_REGION") or None,
        "access_key": env_str("ARTIFACTS_S3_ACCESS_KEY") or None,  # None: boto3's own lookup (env, role)
        "secret_key": env_str("ARTIFACTS_S3_SECRET_KEY") or None,
        "location": env_str("ARTIFACTS_S3_PREFIX", "artifacts"),
        "default_acl": None, "querystring_auth": True, "file_overwrite": True,
        "signature_version": "s3v4",  # presigned downloads (SigV2 URLs with response headers fail on SeaweedFS)
    }}
    if not STORAGES["artifacts"]["OPTIONS"]["bucket_name"]:
        raise ImproperlyConfigured("ARTIFACTS_STORAGE=s3 needs ARTIFACTS_S3_BUCKET")
elif ARTIFACTS_STORAGE == "local":
    STORAGES["artifacts"] = {"BACKEND": "django.core.files.storage.FileSystemStorage", "OPTIONS": {
        "location": env_str("ARTIFACTS_ROOT", str(VAR_DIR / "artifacts")),
        "file_permissions_mode": 0o600, "directory_permissions_mode": 0o700}}
else:
    raise ImproperlyConfigured(f"ARTIFACTS_STORAGE: expected local or s3, got {ARTIFACTS_STORAGE!r}")
# What one attempt of a job may leave (413 past it; the agent stops uploading and the job's message says so).
ARTIFACTS_MAX_MB = env_int("ARTIFACTS_MAX_MB", 1024, minimum=1)
ARTIFACTS_MAX_FILES = env_int("ARTIFACTS_MAX_FILES", 1000, minimum=1)
# Days an artifact is kept after its upload, unless its project's quota says otherwise
# (Quota.artifact_retention_days); 0 keeps them forever. The storage.artifacts_expire beat task deletes them.
ARTIFACTS_RETENTION_DAYS = env_int("ARTIFACTS_RETENTION_DAYS", 0, minimum=0)
# With ARTIFACTS_STORAGE=s3 a download answers with a redirect to a presigned URL valid this many
# seconds (the bytes then never pass through the portal); 0 streams them through the portal instead.
ARTIFACTS_PRESIGN_S = env_int("ARTIFACTS_PRESIGN_S", 300, minimum=0)
if ARTIFACTS_PRESIGN_S > 7 * 24 * 3600:
    raise ImproperlyConfigured("ARTIFACTS_PRESIGN_S: at most 604800 (7 days, the longest a SigV4 URL lives)")
# With ARTIFACTS_STORAGE=s3 a node (agent 1.6+) uploads artifacts straight to the storage at presigned
# PUT URLs valid this many seconds (portal/storage/artifact_direct.py); 0 relays them through the portal.
ARTIFACTS_UPLOAD_PRESIGN_S = env_int("ARTIFACTS_UPLOAD_PRESIGN_S", 300, minimum=0)
if ARTIFACTS_UPLOAD_PRESIGN_S > 7 * 24 * 3600:
    raise ImproperlyConfigured("ARTIFACTS_UPLOAD_PRESIGN_S: at most 604800 (7 days, the longest a SigV4 URL lives)")
WHITENOISE_USE_FINDERS = True  # serve straight from static/ without collectstatic in development

# Request bodies: the API takes JSON specs, never uploads. 1 MiB is generous.
DATA_UPLOAD_MAX_MEMORY_SIZE = env_int("MAX_REQUEST_BYTES", 1024 * 1024, minimum=1024)

CACHES = {
    # Redis that degrades to misses when unreachable (portal/core/cache.py): the cache holds
    # nothing that must survive, so its outage must not fail heartbeats or requests.
    "default": {
        "BACKEND": "portal.core.cache.ResilientRedisCache",
        "LOCATION": env_str("REDIS_URL"),
        "OPTIONS": {"socket_connect_timeout": 1.0, "socket_timeout": 1.0},
    }
    if env_str("REDIS_URL")
    else {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}
}

# Security: on by default whenever DEBUG is off; each can be relaxed behind a TLS proxy.
SECURE_SSL_REDIRECT = env_bool("SECURE_SSL_REDIRECT", not DEBUG)
SESSION_COOKIE_SECURE = env_bool("SESSION_COOKIE_SECURE", not DEBUG)
CSRF_COOKIE_SECURE = env_bool("CSRF_COOKIE_SECURE", not DEBUG)
SECURE_HSTS_SECONDS = env_int("SECURE_HSTS_SECONDS", 0 if DEBUG else 31536000, minimum=0)
SECURE_HSTS_INCLUDE_SUBDOMAINS = env_bool("SECURE_HSTS_INCLUDE_SUBDOMAINS", not DEBUG)
SECURE_HSTS_PRELOAD = env_bool("SECURE_HSTS_PRELOAD", not DEBUG)
SECURE_CONTENT_TYPE_NOSNIFF = True
SECURE_REFERRER_POLICY = "same-origin"
if env_bool("USE_X_FORWARDED_PROTO", False):
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
SESSION_COOKIE_HTTPONLY = True
SESSION_COOKIE_AGE = env_int("SESSION_COOKIE_AGE", 12 * 3600, minimum=60)
X_FRAME_OPTIONS = "DENY"
# Sent on every response. Scripts come only from our static files (templates hold no inline
# script or on* handler); style attributes stay allowed for the server-computed bar widths.
CONTENT_SECURITY_POLICY = {
    "default-src": ["'self'"],
    "script-src": ["'self'"],
    "style-src": ["'self'", "'unsafe-inline'"],
    "img-src": ["'self'", "data:"],
    "object-src": ["'none'"],
    "base-uri": ["'self'"],
    "form-action": ["'self'"],
    "frame-ancestors": ["'none'"],
}

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "portal.accounts.auth.BearerTokenAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": [
        "rest_framework.permissions.IsAuthenticated",
        "portal.accounts.auth.TokenScopePermission",
    ],
    "DEFAULT_PARSER_CLASSES": ["portal.core.rest.SizeLimitedJSONParser"],
    "DEFAULT_RENDERER_CLASSES": [
        "rest_framework.renderers.JSONRenderer",
        "rest_framework.renderers.BrowsableAPIRenderer",
    ],
    "DEFAULT_FILTER_BACKENDS": ["django_filters.rest_framework.DjangoFilterBackend"],
    "DEFAULT_PAGINATION_CLASS": "portal.core.rest.Pagination",
    "PAGE_SIZE": 50,
    "EXCEPTION_HANDLER": "portal.core.api.exception_handler",
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "DEFAULT_THROTTLE_CLASSES": [
        "rest_framework.throttling.AnonRateThrottle",
        "portal.core.throttling.UserRateThrottle",  # counted in O(1) a request (portal/core/throttling.py)
    ],
    "DEFAULT_THROTTLE_RATES": {
        "anon": env_str("API_ANON_RATE", "60/min"),
        "user": env_str("API_USER_RATE", "6000/min"),
    },
    "UNAUTHENTICATED_USER": "django.contrib.auth.models.AnonymousUser",
}
SPECTACULAR_SETTINGS = {
    "TITLE": "gpuportal API",
    "DESCRIPTION": "Multi-tenant GPU job service. Authenticate with `Authorization: Bearer gpp_...`.",
    "VERSION": "1.0.0",
    "SERVE_INCLUDE_SCHEMA": False,
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
    "COMPONENT_SPLIT_REQUEST": True,
    "APPEND_COMPONENTS": {
        "securitySchemes": {"bearerAuth": {"type": "http", "scheme": "bearer", "bearerFormat": "gpp_ token"}}
    },
    "SECURITY": [{"bearerAuth": []}],
    "ENUM_NAME_OVERRIDES": {
        "JobStateEnum": "portal.jobs.models.JobState",
        "NodeStateEnum": "portal.nodes.models.NodeState",
        "AgentEventStateEnum": "agents.protocol.EVENT_STATES",
    },
}

# API tokens.
TOKEN_DEFAULT_EXPIRY_DAYS = env_int("TOKEN_DEFAULT_EXPIRY_DAYS", 90, minimum=1)
TOKEN_MAX_EXPIRY_DAYS = env_int("TOKEN_MAX_EXPIRY_DAYS", 365, minimum=1)

# Celery: Redis in production and CI; a broker that needs no server for the embedded default.
CELERY_BROKER_URL = env_str("CELERY_BROKER_URL", "filesystem://")
if not CELERY_BROKER_URL.split("://", 1)[0] in ("filesystem", "redis", "rediss", "amqp", "memory"):
    raise ImproperlyConfigured(
        f"CELERY_BROKER_URL: unsupported scheme in {CELERY_BROKER_URL!r} (use redis:// or filesystem://)"
    )
if CELERY_BROKER_URL.startswith("filesystem://"):
    _queue_dir = VAR_DIR / "celery" / "queue"
    _queue_dir.mkdir(parents=True, exist_ok=True)
    (VAR_DIR / "celery" / "processed").mkdir(parents=True, exist_ok=True)
    CELERY_BROKER_TRANSPORT_OPTIONS = {
        "data_folder_in": str(_queue_dir),
        "data_folder_out": str(_queue_dir),
        "processed_folder": str(VAR_DIR / "celery" / "processed"),
        "store_processed": False,
    }
else:
    # Longer than any of our tasks, so a slow task is never delivered twice while it runs.
    CELERY_BROKER_TRANSPORT_OPTIONS = {"visibility_timeout": env_int("CELERY_VISIBILITY_TIMEOUT", 3600)}
CELERY_TASK_IGNORE_RESULT = True
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_TASK_DEFAULT_QUEUE = "default"
CELERY_BEAT_SCHEDULE_FILENAME = str(VAR_DIR / "celerybeat-schedule")
CELERY_TIMEZONE = "UTC"

# Project volumes (docs/storage.md): a directory tree at the same path on the portal and every node.
VOLUMES_ROOT = Path(env_str("VOLUMES_ROOT", str(VAR_DIR / "volumes")))
VOLUME_UPLOAD_MAX_MB = env_int("VOLUME_UPLOAD_MAX_MB", 1024, minimum=1)
# Datasets (docs/storage.md): hosts the portal and the nodes may fetch sources from (shell patterns on the
# URL's or endpoint's host; empty: any), the largest upload, objects per version, and how long a node's
# presigned URL for a bucket's object stays valid.
DATASET_SOURCE_HOSTS = env_list("DATASET_SOURCE_HOSTS", [])
DATASET_UPLOAD_MAX_MB = env_int("DATASET_UPLOAD_MAX_MB", 10240, minimum=1)
DATASET_MAX_FILES = env_int("DATASET_MAX_FILES", 10000, minimum=1)
DATASET_URL_TTL_S = env_int("DATASET_URL_TTL_S", 6 * 3600, minimum=60)
# A version whose reading began this long ago and is still pending is read again (its worker died).
DATASET_INSPECT_STALE_S = env_int("DATASET_INSPECT_STALE_S", 6 * 3600, minimum=60)
# The uids the docker sandbox runs projects' jobs under (uid = gid = first + project id); the portal
# gives a volume's folders and uploads to that uid so the project's jobs can write them.
JOB_UIDS = env_str("GPUPORTAL_JOB_UIDS", "2000000-2999999")

# Jobs and scheduling.
JOB_ARRAY_MAX_TASKS = env_int("JOB_ARRAY_MAX_TASKS", 1000, minimum=1)
# Jobs one batch submit (POST /api/v1/jobs/batch/) may hold; the request body limit applies too.
JOB_BATCH_MAX_JOBS = env_int("JOB_BATCH_MAX_JOBS", 10000, minimum=1)
JOB_DEFAULT_TIME_LIMIT_S = env_int("JOB_DEFAULT_TIME_LIMIT_S", 3600, minimum=1)
# Each attempt keeps at most this many bytes of log (the head, then a truncation notice).
JOB_LOG_MAX_BYTES = env_int("JOB_LOG_MAX_BYTES", 10 * 1024 * 1024, minimum=4096)
SCHEDULER_POLICY = env_str("SCHEDULER_POLICY", "multifactor")
# Guaranteed quotas take part in scheduling (borrowing, guarantee-first order, preemption for a
# guarantee); off, only a quota's hard limits hold (docs/scheduler.md).
SCHEDULER_QUOTAS = env_bool("SCHEDULER_QUOTAS", True)
SCHEDULER_PLACEMENT = env_str("SCHEDULER_PLACEMENT", "bestfit")
SCHEDULER_MIN_RUNTIME_S = env_int("SCHEDULER_MIN_RUNTIME_S", 600, minimum=0)
# Requested passes start at least this far apart (Slurm's sched_min_interval); requests meanwhile
# coalesce into the next one (portal/core/passes.py).
SCHEDULER_PASS_INTERVAL_S = env_float("SCHEDULER_PASS_INTERVAL_S", 0.2)
# A pass that finds nothing changed since the last full one (same rows read, no note pending)
# reuses its plan for up to this long; time alone (ages, minimum runtimes) waits at most this.
SCHEDULER_REPLAN_S = env_int("SCHEDULER_REPLAN_S", 30, minimum=0)
SCHEDULER_FAIRSHARE_HALF_LIFE_S = env_int("SCHEDULER_FAIRSHARE_HALF_LIFE_S", 7 * 86400, minimum=60)
# Dataset locality (docs/scheduler.md): a job naming datasets that could start now only on nodes
# without them, while a node holding them all is busy, waits for it up to this long after it entered
# the queue (0: never waits, the bonus only); a reservation due within the horizon asks its node to
# prefetch the datasets it lacks (agent.prefetch), each (node, dataset) at most once per horizon
# (0, the default: no prefetch; the simulator found it moved far more than it saved).
SCHEDULER_LOCALITY_WAIT_S = env_int("SCHEDULER_LOCALITY_WAIT_S", 60, minimum=0)
# A node that reports a job not startable there now (its dataset cache full of what running jobs read)
# gets no launch of that job for this many seconds; the job is requeued without counting a failure.
SCHEDULER_NOT_STARTABLE_AVOID_S = env_int("SCHEDULER_NOT_STARTABLE_AVOID_S", 300, minimum=0)
SCHEDULER_PREFETCH_HORIZON_S = env_int("SCHEDULER_PREFETCH_HORIZON_S", 0, minimum=0)
# Kept from each node's registered CPUs and memory for its own system (agent, engine, kernel): the
# scheduler places jobs, GPU or CPU-only, only while their cpus and memory_mb fit in the rest.
NODE_RESERVED_CPUS = env_float("NODE_RESERVED_CPUS", 0.0)
NODE_RESERVED_MEMORY_MB = env_int("NODE_RESERVED_MEMORY_MB", 1024, minimum=0)
if NODE_RESERVED_CPUS < 0:
    raise ImproperlyConfigured(f"NODE_RESERVED_CPUS: must be at least 0, got {NODE_RESERVED_CPUS}")
LAUNCH_RESEND_S = env_int("LAUNCH_RESEND_S", 60, minimum=1)
# How long the spec a pass published stays in the cache for the node's confirmation (portal/launch.py);
# 0: every confirmation builds it from the database.
LAUNCH_SPEC_CACHE_S = env_int("LAUNCH_SPEC_CACHE_S", 30, minimum=0)
# A job assigned or starting this long that its node's heartbeats do not list (neither launching
# nor running there) was lost on the way: it is requeued (portal/agentapi/heartbeat.py).
LAUNCH_LOST_S = env_int("LAUNCH_LOST_S", 180, minimum=1)
if LAUNCH_LOST_S <= LAUNCH_RESEND_S:
    raise ImproperlyConfigured(f"LAUNCH_LOST_S: {LAUNCH_LOST_S} must be longer than LAUNCH_RESEND_S "
                               f"({LAUNCH_RESEND_S}), so a lost launch is re-sent before its job is requeued")
# Autoscaling (docs/autoscaling.md): the node pools themselves are rows (admin, /console/autoscaling/).
# How often the autoscaler ticks (beat); the URL the nodes it starts give their agents; where the
# `local` provider keeps its agents' folders.
AUTOSCALE_INTERVAL_S = env_float("AUTOSCALE_INTERVAL_S", 10.0)
if AUTOSCALE_INTERVAL_S <= 0:
    raise ImproperlyConfigured(f"AUTOSCALE_INTERVAL_S: must be above 0, got {AUTOSCALE_INTERVAL_S:g}")
AUTOSCALE_PORTAL_URL = env_str("AUTOSCALE_PORTAL_URL", "http://127.0.0.1:8000")
AUTOSCALE_LOCAL_ROOT = Path(env_str("AUTOSCALE_LOCAL_ROOT", str(VAR_DIR / "autoscale")))
TESTING_CRASHPOINTS = env_bool("GPUPORTAL_CRASHPOINTS", False)
# Nodes and agents (seconds; docs/configuration.md, "Node leases"). An agent that has not had a
# heartbeat answered for AGENT_LEASE_S stops its sandboxes (SIGTERM, AGENT_FENCE_GRACE_S, SIGKILL);
# the portal marks a node silent for NODE_TIMEOUT_S down and requeues its jobs, so the old
# attempt is dead before a new one can start. The reaper runs every NODE_REAP_INTERVAL_S: a
# dead node's jobs are requeued at most NODE_TIMEOUT_S + NODE_REAP_INTERVAL_S after its last
# heartbeat (25 s by default).
NODE_HEARTBEAT_INTERVAL_S = env_float("NODE_HEARTBEAT_INTERVAL_S", 5.0)
AGENT_LEASE_S = env_float("AGENT_LEASE_S", 15.0)
AGENT_FENCE_GRACE_S = env_float("AGENT_FENCE_GRACE_S", 3.0)
NODE_TIMEOUT_S = env_float("NODE_TIMEOUT_S", 20.0)
NODE_REAP_INTERVAL_S = env_float("NODE_REAP_INTERVAL_S", 5.0)
NODE_MASS_FAILURE_FRACTION = env_float("NODE_MASS_FAILURE_FRACTION", 0.5)
JOB_MAX_ATTEMPTS = env_int("JOB_MAX_ATTEMPTS", 3, minimum=1)
# Tests only (pytest.ini sets it): a node takes jobs from add_node and registration on, as if its
# agent had answered its queue probe, so scheduling tests need no agent. The probe's own tests
# (tests/nodes/test_node_join.py) turn it off.
TEST_NODES_SKIP_QUEUE_PROBE = env_bool("GPUPORTAL_TEST_NODES_SKIP_QUEUE_PROBE", False)
# The agent checks its lease every second and a SIGKILL takes a moment: the portal waits this
# much beyond the agent's lease and fence grace before it may start the job elsewhere.
NODE_FENCE_MARGIN_S = 2.0
for _name in ("NODE_HEARTBEAT_INTERVAL_S", "AGENT_LEASE_S", "NODE_TIMEOUT_S", "NODE_REAP_INTERVAL_S"):
    if globals()[_name] <= 0:
        raise ImproperlyConfigured(f"{_name}: must be a positive number of seconds")
if AGENT_FENCE_GRACE_S < 0:
    raise ImproperlyConfigured("AGENT_FENCE_GRACE_S: must be 0 or more seconds")
if AGENT_LEASE_S < 2 * NODE_HEARTBEAT_INTERVAL_S:
    raise ImproperlyConfigured(
        f"AGENT_LEASE_S: {AGENT_LEASE_S:g} is less than two heartbeats ({2 * NODE_HEARTBEAT_INTERVAL_S:g}s at "
        f"NODE_HEARTBEAT_INTERVAL_S={NODE_HEARTBEAT_INTERVAL_S:g}); one lost heartbeat would stop every job")
if NODE_TIMEOUT_S < AGENT_LEASE_S + AGENT_FENCE_GRACE_S + NODE_FENCE_MARGIN_S:
    raise ImproperlyConfigured(
        f"NODE_TIMEOUT_S: {NODE_TIMEOUT_S:g} must be at least AGENT_LEASE_S + AGENT_FENCE_GRACE_S + "
        f"{NODE_FENCE_MARGIN_S:g}s = {AGENT_LEASE_S + AGENT_FENCE_GRACE_S + NODE_FENCE_MARGIN_S:g}, so a cut-off "
        f"agent has killed its sandboxes before the portal starts their jobs elsewhere")
PREEMPT_GRACE_S = env_int("PREEMPT_GRACE_S", 30, minimum=0)
# The longest `checkpoint.grace_s` a job may ask for: how long its GPUs may stay busy saving.
CHECKPOINT_MAX_GRACE_S = env_int("CHECKPOINT_MAX_GRACE_S", 900, minimum=1)
if SCHEDULER_POLICY not in ("fifo", "fifo-backfill", "multifactor", "las"):
    raise ImproperlyConfigured(
        f"SCHEDULER_POLICY: use fifo, fifo-backfill, multifactor or las, got {SCHEDULER_POLICY!r}")
if SCHEDULER_PLACEMENT not in ("bestfit", "spread"):
    raise ImproperlyConfigured(f"SCHEDULER_PLACEMENT: use bestfit or spread, got {SCHEDULER_PLACEMENT!r}")

DEMO_PASSWORD = env_str("DEMO_PASSWORD", "demo-pass-123")

# Email (job notifications, sent by the `jobs.notify` task): SMTP unless EMAIL_BACKEND says
# otherwise; a development server prints mails to its console instead.
EMAIL_BACKEND = env_str("EMAIL_BACKEND", "django.core.mail.backends.console.EmailBackend" if DEBUG
                        else "django.core.mail.backends.smtp.EmailBackend")
EMAIL_HOST = env_str("EMAIL_HOST", "localhost")
EMAIL_PORT = env_int("EMAIL_PORT", 25, minimum=1)
EMAIL_HOST_USER = env_str("EMAIL_HOST_USER")
EMAIL_HOST_PASSWORD = env_str("EMAIL_HOST_PASSWORD")
EMAIL_USE_TLS = env_bool("EMAIL_USE_TLS", False)
EMAIL_USE_SSL = env_bool("EMAIL_USE_SSL", False)
if EMAIL_USE_TLS and EMAIL_USE_SSL:
    raise ImproperlyConfigured("EMAIL_USE_TLS and EMAIL_USE_SSL: set one (STARTTLS on 587, or TLS on 465), not both")
EMAIL_TIMEOUT = env_int("EMAIL_TIMEOUT", 10, minimum=1)  # a stuck SMTP server must not hold a worker
DEFAULT_FROM_EMAIL = env_str("DEFAULT_FROM_EMAIL", "gpuportal <noreply@localhost>")
# The portal's public address, for links in emails (e.g. https://gpu.example.com); empty: paths only.
PORTAL_URL = env_str("PORTAL_URL").rstrip("/")

# Billing (docs/billing.md): currency of new rate cards, budget warning share. Metering runs
# every 60 s from beat (portal/celery.py).
BILLING_CURRENCY = env_str("BILLING_CURRENCY", "USD")
BILLING_BUDGET_WARN_FRACTION = env_float("BILLING_BUDGET_WARN_FRACTION", 0.8)
if not 0 < BILLING_BUDGET_WARN_FRACTION < 1:
    raise ImproperlyConfigured("BILLING_BUDGET_WARN_FRACTION: must be between 0 and 1, e.g. 0.8")
# Metrics: /metrics also answers `Authorization: Bearer <METRICS_SCRAPE_TOKEN>` when set (Prometheus).
METRICS_SCRAPE_TOKEN = env_str("METRICS_SCRAPE_TOKEN")
if METRICS_SCRAPE_TOKEN and len(METRICS_SCRAPE_TOKEN) < 32:
    raise ImproperlyConfigured("METRICS_SCRAPE_TOKEN: use at least 32 random characters")
METRICS_RAW_DAYS = env_int("METRICS_RAW_DAYS", 7, minimum=1)  # raw GPU samples
METRICS_MINUTE_DAYS = env_int("METRICS_MINUTE_DAYS", 14, minimum=1)  # 1-minute rollups; 1-hour ones stay
# Heartbeat samples are buffered per web process and written with one COPY per batch.
METRICS_INGEST_BATCH = env_int("METRICS_INGEST_BATCH", 500, minimum=1)
METRICS_INGEST_FLUSH_S = env_float("METRICS_INGEST_FLUSH_S", 2.0)
# GPU health rules applied to every heartbeat sample: over these, the GPU is marked unhealthy.
GPU_HEALTH_MAX_TEMP_C = env_float("GPU_HEALTH_MAX_TEMP_C", 90.0)
GPU_HEALTH_MAX_ECC_ERRORS = env_int("GPU_HEALTH_MAX_ECC_ERRORS", 0, minimum=0)
GPU_HEALTH_IGNORED_XIDS = [int(x) for x in env_list("GPU_HEALTH_IGNORED_XIDS", []) if x.isdigit()]
# A GPU turning unhealthy drains its node (no new jobs there) when on; off, only the GPU is avoided.
GPU_HEALTH_AUTO_DRAIN = env_bool("GPU_HEALTH_AUTO_DRAIN", False)
# A GPU under a running job whose utilization stays below this for this long is flagged idle.
GPU_IDLE_UTIL_PCT = env_float("GPU_IDLE_UTIL_PCT", 5.0)
GPU_IDLE_MINUTES = env_int("GPU_IDLE_MINUTES", 30, minimum=1)
# Interactive sessions (docs/sessions.md). Defaults for projects without a session policy (0: never).
SESSION_IDLE_TIMEOUT_S = env_int("SESSION_IDLE_TIMEOUT_S", 3600, minimum=0)
SESSION_MAX_LIFETIME_S = env_int("SESSION_MAX_LIFETIME_S", 0, minimum=0)
# How long an idle session's owner is warned before its job is stopped.
SESSION_IDLE_GRACE_S = env_int("SESSION_IDLE_GRACE_S", 300, minimum=0)
# Proxied connections one user may hold open at once in one ASGI process (HTTP and WebSockets).
SESSION_MAX_CONNECTIONS_PER_USER = env_int("SESSION_MAX_CONNECTIONS_PER_USER", 64, minimum=1)
# The largest WebSocket message the proxy passes in either direction.
SESSION_MAX_FRAME_BYTES = env_int("SESSION_MAX_FRAME_BYTES", 16 * 1024 * 1024, minimum=1024)

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": env_str("LOG_LEVEL", "INFO")},
    "loggers": {"django.db.backends": {"level": "WARNING"}, "axes": {"level": "WARNING"}},
}
# Quiet by default: what runs every few seconds (beat sending a pass, a worker taking and finishing
# it, an agent's heartbeat request) shows only at LOG_LEVEL=DEBUG; what changed stays at INFO.
_ROUTINE_LEVEL = "DEBUG" if env_str("LOG_LEVEL", "INFO").upper() == "DEBUG" else "WARNING"
LOGGING["filters"] = {"routine_requests": {"()": "portal.core.logfilters.RoutineRequests"}}
LOGGING["formatters"]["server"] = {"format": "%(asctime)s %(message)s"}
LOGGING["handlers"]["server"] = {"class": "logging.StreamHandler", "formatter": "server",
                                 "filters": ["routine_requests"]}
LOGGING["loggers"].update({
    "django.server": {"handlers": ["server"], "level": "INFO", "propagate": False},
    "celery.beat": {"level": _ROUTINE_LEVEL},  # "Scheduler: Sending due task ..."
    "celery.worker.strategy": {"level": _ROUTINE_LEVEL},  # "Task ... received"
    "celery.app.trace": {"level": _ROUTINE_LEVEL},  # "Task ... succeeded in ..." (failures are ERROR)
    "kombu.connection": {"level": "ERROR"},  # "No hostname was supplied" for filesystem://
})
