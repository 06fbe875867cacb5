"""A test web server run inside a sandbox by test_ports.py (and the console's
browser test): python3 port_server.py PORT. Standard library only.

  GET  /echo...        -> JSON {method, path, headers}: what reached the upstream
  GET  /big?n=N        -> N bytes (Content-Length), the pattern bytes(range(256))
  POST /upload         -> JSON {bytes, sha256} of the body (Content-Length or chunked)
  GET  /sse            -> text/event-stream, close-delimited: "one", then "two" once
                          /tmp/sse-go exists
  GET  /ws             -> a WebSocket that echoes text and binary messages
  GET  /               -> a small HTML page
"""

import base64
import hashlib
import http.server
import json
import os
import socketserver
import sys
import time

GUID = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
PATTERN = bytes(range(256)) * 4096  # 1 MiB


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # a head and a body in two writes: no 40 ms wait

    def log_message(self, *a):
        pass

    def _json(self, doc, status=200):
        body = json.dumps(doc).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_HEAD(self):
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", "1234")
        self.end_headers()

    def do_GET(self):
        if self.path.startswith("/echo"):
            return self._json({"method": "GET", "path": self.path,
                               "headers": [[k, v] for k, v in self.headers.items()]})
        if self.path.startswith("/big"):
            n = int(self.path.split("n=", 1)[1])
            self.send_response(200)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(n))
            self.end_headers()
            left = n
            while left > 0:
                chunk = PATTERN[:min(left, len(PATTERN))]
                self.wfile.write(chunk)
                left -= len(chunk)
            return
        if self.path == "/sse":
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(b"data: one\n\n")
            self.wfile.flush()
            deadline = time.monotonic() + 30
            while not os.path.exists("/tmp/sse-go") and time.monotonic() < deadline:
                time.sleep(0.05)
            self.wfile.write(b"data: two\n\n")
            self.close_connection = True
            return
        if self.path == "/ws":
            return self._websocket()
        if self.path == "/" or self.path.startswith("/?"):
            body = (b"<!doctype html><html><head><title>port page</title></head><body>"
                    b"<h1 id=hello>hello from the sandbox</h1></body></html>")
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        self._json({"error": "no such path"}, 404)

    def do_POST(self):
        h = hashlib.sha256()
        total = 0
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            while True:
                size = int(self.rfile.readline().strip(), 16)
                if size == 0:
                    self.rfile.readline()
                    break
                data = self.rfile.read(size)
                h.update(data)
                total += len(data)
                self.rfile.readline()
        else:
            left = int(self.headers.get("Content-Length", "0"))
            while left > 0:
                data = self.rfile.read(min(left, 1 << 20))
                if not data:
                    break
                h.update(data)
                total += len(data)
                left -= len(data)
        self._json({"bytes": total, "sha256": h.hexdigest()})

    def _websocket(self):
        key = self.headers.get("Sec-WebSocket-Key", "")
        accept = base64.b64encode(hashlib.sha1((key + GUID).encode()).digest()).decode()
        self.send_response(101)
        self.send_header("Upgrade", "websocket")
        self.send_header("Connection", "Upgrade")
        self.send_header("Sec-WebSocket-Accept", accept)
        self.end_headers()
        self.wfile.flush()
        rf, wf = self.rfile, self.wfile
        while True:
            head = rf.read(2)
            if len(head) < 2:
                break
            op = head[0] & 0x0F
            n = head[1] & 0x7F
            if n == 126:
                n = int.from_bytes(rf.read(2), "big")
            elif n == 127:
                n = int.from_bytes(rf.read(8), "big")
            mask = rf.read(4) if head[1] & 0x80 else b"\0\0\0\0"
            data = bytearray(rf.read(n))
            for i in range(len(data)):
                data[i] ^= mask[i % 4]
            if op == 8:  # close: answer it
                wf.write(bytes([0x88, len(data)]) + bytes(data))
                wf.flush()
                break
            if op in (1, 2):
                out = bytes([0x80 | op])
                if len(data) < 126:
                    out += bytes([len(data)])
                elif len(data) < 65536:
                    out += bytes([126]) + len(data).to_bytes(2, "big")
                else:
                    out += bytes([127]) + len(data).to_bytes(8, "big")
                wf.write(out + bytes(data))
                wf.flush()
        self.close_connection = True


class Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
    allow_reuse_address = True


if __name__ == "__main__":
    port = int(sys.argv[1])
    Server(("127.0.0.1", port), Handler).serve_forever()
