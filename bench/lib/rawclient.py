"""A minimal stdlib REST client with the SDK's shape (Client.from_data_dir,
create, Sandbox.exec/destroy), used by the benchmarks when sdk/python/dsec cannot
be imported. One keep-alive connection per Client; a Client is not thread-safe
(the benchmarks use one per thread)."""

import collections
import http.client
import json
import os
import urllib.parse

ExecResult = collections.namedtuple(
    "ExecResult", "exit_code stdout stderr signal timed_out truncated oom_killed duration_ms")


class ApiError(Exception):
    def __init__(self, status, code, message):
        super().__init__("HTTP %d %s: %s" % (status, code, message))
        self.status, self.code, self.message = status, code, message


class Client:
    def __init__(self, url, token, timeout=120.0):
        u = urllib.parse.urlsplit(url)
        self._host, self._port = u.hostname, u.port or 80
        self._token = token
        self._timeout = timeout
        self._conn = None

    @classmethod
    def from_data_dir(cls, data_dir, **kw):
        with open(os.path.join(data_dir, "up.json")) as f:
            url = json.load(f)["url"]
        with open(os.path.join(data_dir, "token")) as f:
            token = f.read().strip()
        return cls(url, token, **kw)

    def _request(self, method, path, body=None):
        data = None if body is None else json.dumps(body).encode()
        headers = {"Authorization": "Bearer " + self._token}
        if data is not None:
            headers["Content-Type"] = "application/json"
        for attempt in (0, 1):
            if self._conn is None:
                self._conn = http.client.HTTPConnection(self._host, self._port, timeout=self._timeout)
            try:
                self._conn.request(method, path, body=data, headers=headers)
                resp = self._conn.getresponse()
                raw = resp.read()
                break
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError):
                # The server closed an idle keep-alive connection; retry once on a new one.
                self._conn.close()
                self._conn = None
                if attempt:
                    raise
        if resp.getheader("Connection", "").lower() == "close":
            self._conn.close()
            self._conn = None
        obj = json.loads(raw) if raw else {}
        if resp.status >= 400:
            err = obj.get("error", {}) if isinstance(obj, dict) else {}
            raise ApiError(resp.status, err.get("code", "?"), err.get("message", raw[:200]))
        return obj

    def create(self, image, backend="container", **kw):
        body = {"image": image, "backend": backend}
        body.update(kw)
        return Sandbox(self, self._request("POST", "/v1/sandboxes", body))

    def run(self, code, language="python", image=None, timeout=None):
        """POST /v1/run: one fncall call (docs/fncall.md)."""
        body = {"code": code, "language": language}
        if image is not None:
            body["image"] = image
        if timeout is not None:
            body["timeout_s"] = timeout
        r = self._request("POST", "/v1/run", body)
        return ExecResult(r.get("exit_code"), r.get("stdout", ""), r.get("stderr", ""),
                          r.get("signal", 0), r.get("timed_out", False), r.get("truncated", False),
                          r.get("oom_killed", False), r.get("duration_ms"))

    def close(self):
        if self._conn:
            self._conn.close()
            self._conn = None


class Sandbox:
    def __init__(self, client, obj):
        self._client = client
        self.id = obj["id"]
        self.info = obj

    def exec(self, cmd, timeout=60):
        r = self._client._request("POST", "/v1/sandboxes/%s/exec" % self.id,
                                  {"cmd": cmd, "timeout_s": timeout})
        return ExecResult(r.get("exit_code"), r.get("stdout", ""), r.get("stderr", ""),
                          r.get("signal", 0), r.get("timed_out", False), r.get("truncated", False),
                          r.get("oom_killed", False), r.get("duration_ms"))

    def destroy(self):
        self.info = self._client._request("DELETE", "/v1/sandboxes/%s" % self.id)
        return self.info
