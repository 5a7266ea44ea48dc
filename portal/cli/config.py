"""Where gpuctl keeps the portal's URL and your token, and how the environment overrides them.

The file is `$GPUCTL_CONFIG`, else `$XDG_CONFIG_HOME/gpuctl/config.json` (~/.config/...). It holds
a secret, so it is written 0600 in a 0700 directory, through a temporary file that is renamed
into place (a crash never leaves half a token). `GPUCTL_URL` and `GPUCTL_TOKEN` win over the
file, so CI jobs need no file at all.
"""
import json
import os
import stat
import sys
from dataclasses import dataclass
from pathlib import Path

ENV_CONFIG = "GPUCTL_CONFIG"
ENV_URL = "GPUCTL_URL"
ENV_TOKEN = "GPUCTL_TOKEN"


class ConfigError(Exception):
    """Not logged in, or an unreadable config file; the message says what to do."""


@dataclass(frozen=True)
class Credentials:
    url: str
    token: str


def config_path() -> Path:
    if os.environ.get(ENV_CONFIG):
        return Path(os.environ[ENV_CONFIG]).expanduser()
    base = os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config"
    return Path(base) / "gpuctl" / "config.json"


def read_file(path: Path | None = None) -> dict:
    path = path or config_path()
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return {}
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror}") from None
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"{path} is not valid JSON ({exc}); run gpuctl login again") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} should hold a JSON object; run gpuctl login again")
    if os.name == "posix" and stat.S_IMODE(path.stat().st_mode) & 0o077:
        print(f"warning: {path} holds a token but others may read it; run: chmod 600 {path}", file=sys.stderr)
    return data


def save(*, url: str, token: str, path: Path | None = None) -> Path:
    """Write url and token, readable by the owner only. Returns the path written."""
    path = path or config_path()
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    import tempfile  # only a login writes the file; its import (with random) is start-up time

    # mkstemp creates the file 0600 already; the data never sits in a wider-open file.
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".config-", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump({"url": url, "token": token}, f, indent=2)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def overridden_by_env() -> list[str]:
    return [name for name in (ENV_URL, ENV_TOKEN) if os.environ.get(name)]


def load() -> Credentials:
    """The URL and token to use: the environment first, then the config file."""
    url = os.environ.get(ENV_URL) or ""
    token = os.environ.get(ENV_TOKEN) or ""
    if not (url and token):
        data = read_file()
        url = url or str(data.get("url") or "")
        token = token or str(data.get("token") or "")
    if not url or not token:
        missing = " and ".join(n for n, v in (("URL", url), ("token", token)) if not v)
        raise ConfigError(f"no portal {missing} configured: run `gpuctl login --url URL` "
                          f"(or set {ENV_URL} and {ENV_TOKEN})")
    return Credentials(url=url, token=token)
