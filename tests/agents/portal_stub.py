"""A tiny stand-in for the portal's agent API on 127.0.0.1, for HTTP-level tests."""

import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

TOKEN = "gpn_test_token"


class PortalStub:
    def __init__(self):
        self.requests: list = []  # (path, body, headers)
        self.fail_next: list[int] = []  # status codes to answer before behaving
        self.stale: set = set()
        self.spec: dict = {}
        self.stop_list: list = []
        self.refuse: dict[str, int] = {}  # path suffix -> the status every such request gets
        # While set, every request gets the portal's own outage answer (its database is out).
        self.outage = False
        # Cleared by ``freeze``: requests are taken (the kernel accepts the connection) but not answered
        # until ``thaw``, as a portal whose workers are frozen or overloaded.
        self.thawed = threading.Event()
        self.thawed.set()
        self.lock = threading.Lock()
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_POST(self):
                stub.thawed.wait(120)
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
                with stub.lock:
                    stub.requests.append((self.path, body, dict(self.headers)))
                    status = stub.fail_next.pop(0) if stub.fail_next else None
                if status:
                    return self._send(status, {"detail": "injected"})
                if stub.outage:
                    return self._send(503, {"detail": "database out"},
                                      {"Retry-After": "5", "X-Gpuportal-Outage": "database"})
                refused = [code for suffix, code in stub.refuse.items() if self.path.endswith(suffix)]
                if refused:
                    return self._send(refused[0], {"detail": "refused"})
                if self.headers.get("Authorization") != f"Bearer {TOKEN}":
                    return self._send(401, {"detail": "bad token"})
                self._send(*stub.answer(self.path, body))

            def _send(self, status, payload, headers=None):
                data = json.dumps(payload).encode()
                self.send_response(status)
                for name, value in (headers or {}).items():
                    self.send_header(name, value)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                try:
                    self.end_headers()
                    self.wfile.write(data)
                except OSError:  # a client that gave up waiting (the portal was frozen)
                    pass

        self._handler = Handler
        self.port = 0
        self.listen()
        self.url = f"http://127.0.0.1:{self.port}"

    def listen(self):
        """Serve on the stub's port (a free one the first time; the same one after ``stop_listening``)."""
        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), self._handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def freeze(self):
        """Take connections, answer nothing (a frozen or overloaded portal) until ``thaw``."""
        self.thawed.clear()

    def thaw(self):
        self.thawed.set()

    def stop_listening(self):
        """Close the listening socket, as a portal whose web processes are restarting: connections are refused."""
        self.server.shutdown()
        self.server.server_close()

    def answer(self, path, body):
        p = path.removeprefix("/api/agent/v1")
        if p == "/register":
            return 200, {"node": 1, "heartbeat_interval_s": 1, "lease_s": 30}
        if p == "/probe":
            return 200, {"result": "verified"}
        if p == "/heartbeat":
            with self.lock:
                stop, self.stop_list = self.stop_list, []
            return 200, {"drain": False, "stop": stop}
        if p == "/events":  # protocol 1.2: several jobs' reports, each answered as alone ("stale": its 409)
            return 200, {"results": [{"job_id": e.get("job_id"), "result": "stale"
                                      if (e.get("job_id"), e.get("attempt")) in self.stale else "applied"}
                                     for e in body.get("events", [])]}
        m = re.fullmatch(r"/jobs/([^/]+)/(confirm|events|logs)", p)
        if not m:
            return 404, {"detail": "no such endpoint"}
        if (m[1], body.get("attempt")) in self.stale:
            return 409, {"detail": "stale attempt"}
        if m[2] == "confirm":
            return 200, {"spec": self.spec}
        return 200, {}

    def calls(self, suffix):
        """The bodies POSTed to paths ending in ``suffix``; a batch's reports count as their jobs' own
        ``/jobs/<id>/events`` calls (without their job_id), in order."""
        with self.lock:
            out = []
            for p, b, _ in self.requests:
                if p.endswith("/api/agent/v1/events"):
                    out += [{k: v for k, v in e.items() if k != "job_id"} for e in b.get("events", [])
                            if f"/jobs/{e.get('job_id')}/events".endswith(suffix)]
                elif p.endswith(suffix):
                    out.append(b)
            return out

    def close(self):
        self.thaw()
        if self.server.socket.fileno() != -1:
            self.stop_listening()
