"""A small client for the REST API v1 (docs/api.md): one method per call gpuctl makes.

Every failure comes out as one of two exceptions, so the commands handle errors in one place:
`ApiError` carries the API's error shape ({"error": {status, code, message, fields}}) and
`ConnectionFailed` names the URL that could not be reached.
"""
from __future__ import annotations

import re
from typing import TYPE_CHECKING

from . import version

if TYPE_CHECKING:
    import requests

# The exit status for each HTTP error status (docs/cli.md); anything else exits 1.
EXIT_CODES = {400: 2, 401: 3, 403: 3, 404: 4, 409: 5}
# Worth another try while polling: the portal restarting, a proxy hiccup, a throttle.
TRANSIENT_STATUSES = frozenset({429, 502, 503, 504})


class ApiError(Exception):
    """An error response from the portal, in the API's one error shape."""

    def __init__(self, status: int, code: str, message: str, fields: dict | None = None):
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.fields: dict[str, list[str]] = fields or {}

    @property
    def exit_code(self) -> int:
        return EXIT_CODES.get(self.status, 1)

    @property
    def transient(self) -> bool:
        return self.status in TRANSIENT_STATUSES


class ConnectionFailed(Exception):
    """The portal did not answer: wrong URL, server down, DNS, TLS or a timeout."""

    exit_code = 1
    transient = True

    def __init__(self, url: str, reason: str):
        super().__init__(f"cannot reach {url}: {reason}")
        self.url = url
        self.reason = reason


def normalize_url(url: str) -> str:
    """'portal.example.com/api/v1/' -> 'https://portal.example.com' (the API path is ours to add)."""
    url = url.strip().rstrip("/")
    if not re.match(r"^https?://", url):
        url = "https://" + url
    for suffix in ("/api/v1", "/api"):
        if url.endswith(suffix):
            url = url[: -len(suffix)]
    return url


def _reason(exc: requests.RequestException) -> str:
    """requests nests the cause deep in its message; keep the part a person can act on."""
    import requests  # a start-up cost (see Client.__init__): loaded once a call has failed

    text = str(exc)
    if isinstance(exc, requests.exceptions.SSLError):
        return "TLS error: " + (re.findall(r"\[SSL[^\]]*\] ([^(')\"]+)", text) or [text])[0].strip()
    if isinstance(exc, requests.Timeout):
        return "no answer in time"
    found = re.findall(r"\[Errno -?\d+\] ([^'\")]+)", text)
    if found:
        return found[-1].strip()
    return text or type(exc).__name__


class Client:
    def __init__(self, url: str, token: str, *, timeout: float = 30.0):
        self.base_url = normalize_url(url)
        self.timeout = timeout
        self.last_status = 0  # of the latest response: submit tells 201 (created) from 200 (replayed)
        # requests (with urllib3) is a third of gpuctl's start-up: loaded by the commands that call the API.
        import requests

        self._requests = requests
        self.session = requests.Session()
        self.session.headers.update({
            "Authorization": f"Bearer {token}",
            "Accept": "application/json",
            "User-Agent": f"gpuctl/{version()}",
        })

    def close(self) -> None:
        self.session.close()

    def request(self, method: str, path: str, *, params: dict | None = None, body=None,
                headers: dict | None = None, what: str = ""):
        """One call; `what` ("job 12") names the object in a 404's message."""
        url = f"{self.base_url}/api/v1/{path.lstrip('/')}"
        params = {k: v for k, v in (params or {}).items() if v is not None}
        try:
            # No redirects: requests would turn a POST into a GET and drop the token on the way.
            resp = self.session.request(method, url, params=params, json=body, headers=headers,
                                        timeout=(10, self.timeout), allow_redirects=False)
        except self._requests.RequestException as exc:
            raise ConnectionFailed(self.base_url, _reason(exc)) from None
        self.last_status = resp.status_code
        with resp:  # back to the pool even when we raise, so close() really closes the connection
            try:
                return self._handle(resp, url)
            except ApiError as exc:
                if exc.status == 404 and what:
                    # Another tenant's object and a missing one are the same to the API, on purpose.
                    exc.message = f"{what} not found (it does not exist or you may not see it)."
                raise

    def _handle(self, resp: requests.Response, url: str):
        if resp.is_redirect:
            where = resp.headers.get("Location", "?")
            raise ApiError(resp.status_code, "redirect",
                           f"{url} redirects to {where}; log in with the portal's final URL "
                           "(gpuctl login --url ...)")
        if resp.status_code == 204:
            return None
        try:
            data = resp.json()
        except ValueError:
            data = None
        if resp.ok:
            if data is None:
                raise ApiError(resp.status_code, "bad_response",
                               f"{url} answered {resp.headers.get('Content-Type', 'no content type')}, "
                               "not JSON: is this a gpuportal URL?")
            return data
        error = data.get("error") if isinstance(data, dict) else None
        if not isinstance(error, dict):
            raise ApiError(resp.status_code, "http_error", f"HTTP {resp.status_code} {resp.reason} from {url}")
        return self._raise(resp.status_code, error)

    @staticmethod
    def _raise(status: int, error: dict):
        fields = error.get("fields") if isinstance(error.get("fields"), dict) else {}
        fields = {str(k): [str(m) for m in (v if isinstance(v, list) else [v])] for k, v in fields.items()}
        raise ApiError(int(error.get("status") or status), str(error.get("code") or "error"),
                       str(error.get("message") or f"HTTP {status}"), fields)

    def get(self, path: str, what: str = "", **params):
        return self.request("GET", path, params=params, what=what)

    def post(self, path: str, body=None, headers: dict | None = None, what: str = ""):
        return self.request("POST", path, body=body, headers=headers, what=what)

    # The calls gpuctl makes.

    def me(self) -> dict:
        return self.get("me/")

    def job(self, job_id: int) -> dict:
        return self.get(f"jobs/{job_id}/", what=f"job {job_id}")

    def jobs(self, *, limit: int, **filters) -> tuple[list[dict], int]:
        """The newest `limit` jobs matching the filters, and how many match in all."""
        page = self.get("jobs/", page_size=limit, **filters)
        return page["results"][:limit], page["count"]

    def submit(self, spec: dict, *, idempotency_key: str | None = None) -> tuple[dict, bool]:
        """The job, and False when the idempotency key had already created it (HTTP 200, not 201)."""
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else None
        job = self.post("jobs/", spec, headers=headers)
        return job, self.last_status == 201

    def resolve(self, ref: str) -> int:
        """A job id from '12' or an array task's '3_0' (Slurm's <array job>_<index>)."""
        parent, sep, index = str(ref).partition("_")
        if not parent.isascii() or not parent.isdigit() or (sep and not (index.isascii() and index.isdigit())):
            raise ApiError(400, "invalid", f"{ref!r} is not a job id like 12 or an array task like 3_0.")
        if not sep:
            return int(parent)
        page = self.get("jobs/", what=f"job {parent}", array_parent=parent, array_index=index, page_size=1)
        if not page["results"]:
            raise ApiError(404, "not_found", f"job {ref} not found (no such array task, or you may not see it).")
        return page["results"][0]["id"]

    def hold(self, job_id: int) -> dict:
        return self.post(f"jobs/{job_id}/hold/", what=f"job {job_id}")

    def release(self, job_id: int) -> dict:
        return self.post(f"jobs/{job_id}/release/", what=f"job {job_id}")

    def update(self, job_id: int, changes: dict) -> dict:
        return self.request("PATCH", f"jobs/{job_id}/", body=changes, what=f"job {job_id}")

    def move(self, job_id: int) -> dict:
        return self.post(f"jobs/{job_id}/move/", what=f"job {job_id}")

    def cancel(self, job_id: int) -> dict:
        return self.post(f"jobs/{job_id}/cancel/", what=f"job {job_id}")

    def resubmit(self, job_id: int) -> dict:
        return self.post(f"jobs/{job_id}/resubmit/", what=f"job {job_id}")

    def logs(self, job_id: int, *, offset: int = 0, attempt: int | None = None) -> dict:
        return self.get(f"jobs/{job_id}/logs/", what=f"job {job_id}", offset=offset, attempt=attempt)

    def job_usage(self, **params) -> dict:
        return self.get("usage/jobs/", **params)

    def usage(self, **params) -> dict:
        return self.get("usage/", **params)

    def cluster(self) -> dict:
        return self.get("cluster/")

    def project(self, slug: str) -> dict:
        return self.get(f"projects/{slug}/", what=f"project {slug}")

    def projects(self) -> list[dict]:
        projects, page = [], 1
        while True:
            data = self.get("projects/", page=page, page_size=500)
            projects.extend(data["results"])
            if not data.get("next"):
                return projects
            page += 1

    # Volumes (docs/storage.md): files travel as raw bytes, streamed both ways.

    def volumes(self, project: str | None = None) -> list[dict]:
        return self.get("volumes/", project__slug=project, page_size=500)["results"]

    def volume_create(self, body: dict) -> dict:
        return self.post("volumes/", body)

    def volume_files(self, volume_id: int, path: str) -> dict:
        return self._raw("GET", f"volumes/{volume_id}/files/", path)

    def volume_put(self, volume_id: int, path: str, stream) -> dict:
        return self._raw("PUT", f"volumes/{volume_id}/files/", path, data=stream)

    def volume_get(self, volume_id: int, path: str, out) -> int:
        """Write the file into ``out`` (a binary file); returns the bytes written."""
        return self._raw("GET", f"volumes/{volume_id}/download/", path, out=out)

    # Datasets (docs/storage.md): named, versioned, read-only inputs at /datasets/<name>.

    def datasets(self, project: str | None = None) -> list[dict]:
        return self.get("datasets/", project__slug=project, page_size=500)["results"]

    def dataset(self, dataset_id: int) -> dict:
        return self.get(f"datasets/{dataset_id}/", what=f"dataset {dataset_id}")

    def dataset_create(self, body: dict) -> dict:
        return self.post("datasets/", body)

    def dataset_version(self, dataset_id: int, source: dict) -> dict:
        return self.post(f"datasets/{dataset_id}/versions/", {"source": source}, what=f"dataset {dataset_id}")

    def dataset_upload(self, dataset_id: int, filename: str, stream) -> dict:
        return self._raw("PUT", f"datasets/{dataset_id}/upload/", None, data=stream, what=f"dataset {dataset_id}",
                         query={"filename": filename})

    def artifacts(self, job_id: int, attempt: int | None = None) -> list[dict]:
        return self.get(f"jobs/{job_id}/artifacts/", what=f"job {job_id}",
                        **({"attempt": attempt} if attempt is not None else {}))

    def artifact_get(self, job_id: int, artifact_id: int, out) -> int:
        """Write the artifact into ``out`` (a binary file); returns the bytes written."""
        return self._raw("GET", f"jobs/{job_id}/artifacts/{artifact_id}/", None, out=out, what=f"job {job_id}",
                         follow=True)

    def _raw(self, method: str, path: str, file_path: str | None, *, data=None, out=None, what: str = "",
             query: dict | None = None, follow: bool = False):
        """``follow``: a redirect (an S3 storage's presigned URL) is fetched without the session, so
        the portal token never travels to the storage."""
        url = f"{self.base_url}/api/v1/{path}"
        params = {"path": file_path} if file_path is not None else query
        try:
            resp = self.session.request(method, url, params=params,
                                        data=data, stream=out is not None,
                                        headers={"Content-Type": "application/octet-stream"} if data else None,
                                        timeout=(10, self.timeout), allow_redirects=False)
        except self._requests.RequestException as exc:
            raise ConnectionFailed(self.base_url, _reason(exc)) from None
        if follow and out is not None and resp.is_redirect:
            resp.close()
            try:
                resp = self._requests.get(resp.headers["Location"], stream=True, timeout=(10, self.timeout))
            except self._requests.RequestException as exc:
                raise ConnectionFailed(resp.headers["Location"].split("?", 1)[0], _reason(exc)) from None
        self.last_status = resp.status_code
        with resp:
            if out is None or not resp.ok:
                try:
                    return self._handle(resp, url)
                except ApiError as exc:
                    if exc.status == 404 and not exc.fields:
                        exc.message = f"{what or 'volume ' + path.split('/')[1]} not found (it does not exist or " \
                                      f"you may not see it)."
                    raise
            written = 0
            for chunk in resp.iter_content(1024 * 1024):
                out.write(chunk)
                written += len(chunk)
            return written
