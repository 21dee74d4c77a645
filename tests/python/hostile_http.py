"""Hostile HTTP endpoints for the remote-provider tests, on 127.0.0.1 (prints `PORT <n>` first).

  silent    accepts connections and reads requests, never answers
  redirect  answers every request with 307 to the same path on another host (`localhost`
            instead of 127.0.0.1): the broker must not follow it
  endless   a stateless MCP server (one tool, `echo`) whose answer to a call is an SSE stream
            that carries the result and then never ends (a comment every 200 ms): logs
            `CALL <text>` per call and `CLOSED` when the client closed such a stream
"""
import json
import socket
import socketserver
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

mode = sys.argv[1]


class Server(ThreadingHTTPServer):
    """`HTTPServer.server_bind` asks the resolver for the host's full name (`getfqdn`), which
    waits on DNS where no resolver answers; a loopback test server needs no name."""

    daemon_threads = True

    def server_bind(self):
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = self.server_address[:2]

if mode == "silent":
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    print(f"PORT {sock.getsockname()[1]}", flush=True)
    held = []
    while True:
        conn, _ = sock.accept()
        held.append(conn)  # never answered, never closed
elif mode == "endless":
    log_lock = threading.Lock()

    def log(line):
        with log_lock, open(sys.argv[2], "a") as f:
            f.write(line + "\n")

    ECHO = {
        "name": "echo",
        "description": "Echoes its text.",
        "inputSchema": {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]},
    }

    class Endless(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _empty(self, status):
            self.send_response(status)
            self.send_header("content-length", "0")
            self.end_headers()

        def _json(self, body):
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _chunk(self, data):
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            self.wfile.flush()

        def do_GET(self):
            self._empty(405)

        def do_DELETE(self):
            self._empty(200)

        def do_POST(self):
            n = int(self.headers.get("content-length") or 0)
            msg = json.loads(self.rfile.read(n))
            method, rid = msg.get("method"), msg.get("id")
            if rid is None:
                return self._empty(202)
            if method == "initialize":
                return self._json({"jsonrpc": "2.0", "id": rid, "result": {
                    "protocolVersion": msg["params"]["protocolVersion"],
                    "capabilities": {"tools": {}},
                    "serverInfo": {"name": "endless", "version": "1"}}})
            if method == "tools/list":
                return self._json({"jsonrpc": "2.0", "id": rid, "result": {"tools": [ECHO]}})
            if method != "tools/call":
                return self._json({"jsonrpc": "2.0", "id": rid, "error": {"code": -32601, "message": method}})
            text = msg["params"]["arguments"]["text"]
            log(f"CALL {text}")
            answer = {"jsonrpc": "2.0", "id": rid,
                      "result": {"content": [{"type": "text", "text": f"echo: {text}"}]}}
            self.send_response(200)
            self.send_header("content-type", "text/event-stream")
            self.send_header("transfer-encoding", "chunked")
            self.end_headers()
            self.close_connection = True
            try:
                self._chunk(b"event: message\ndata: " + json.dumps(answer).encode() + b"\n\n")
                while True:  # never ends: only the client can end it
                    time.sleep(0.2)
                    self._chunk(b": still here\n\n")
            except OSError:
                log("CLOSED")

        def log_message(self, *a):
            pass

    srv = Server(("127.0.0.1", 0), Endless)
    print(f"PORT {srv.server_port}", flush=True)
    srv.serve_forever()
else:

    class Redirect(BaseHTTPRequestHandler):
        def _go(self):
            n = int(self.headers.get("content-length") or 0)
            self.rfile.read(n)
            self.send_response(307)
            self.send_header("location", f"http://localhost:{self.server.server_port}{self.path}")
            self.send_header("content-length", "0")
            self.end_headers()
            with open(sys.argv[2], "a") as f:
                f.write(f"{self.command} {self.headers.get('host')}\n")

        do_GET = do_POST = do_DELETE = _go

        def log_message(self, *a):
            pass

    srv = Server(("127.0.0.1", 0), Redirect)
    print(f"PORT {srv.server_port}", flush=True)
    srv.serve_forever()
