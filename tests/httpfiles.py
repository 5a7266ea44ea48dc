"""A real HTTP server on a free loopback port serving one folder, for tests that fetch over HTTP (datasets):
it counts the requests per path, so a test can tell a download from a cache hit. Started and stopped by
the ``http_files`` fixture (tests/conftest.py)."""
import functools
import threading
from collections import Counter
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


class FileServer:
    def __init__(self, folder: Path):
        self.folder = folder
        self.requests: Counter = Counter()
        server = self

        class Handler(SimpleHTTPRequestHandler):
            def do_GET(self):
                server.requests[self.path] += 1
                super().do_GET()

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Handler, directory=str(folder)))
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def put(self, name: str, data: bytes) -> str:
        """Write a file to serve; -> its URL."""
        path = self.folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        return f"{self.url}/{name}"

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(10)


def tar_archive(members: dict[str, bytes], *, gz: bool = True, link: tuple[str, str] | None = None) -> bytes:
    """A tar archive (gzip-compressed unless gz=False) of `members`, and a symlink (name, target) when given:
    what dataset sources serve."""
    import io
    import tarfile

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz" if gz else "w") as tf:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o644
            tf.addfile(info, io.BytesIO(data))
        if link:
            info = tarfile.TarInfo(link[0])
            info.type, info.linkname = tarfile.SYMTYPE, link[1]
            tf.addfile(info)
    return buf.getvalue()
