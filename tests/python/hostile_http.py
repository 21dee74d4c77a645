"""Hostile HTTP endpoints for the remote-provider tests, on 127.0.0.1 (prints `PORT <n>` first).

  silent    accepts connections and reads requests, never answers
  redirect  answers every request with 307 to the same path on another host (`localhost`
            instead of 127.0.0.1): the broker must not follow it
"""
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

mode = sys.argv[1]

if mode == "silent":
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    print(f"PORT {sock.getsockname()[1]}", flush=True)
    held = []
    while True:
        conn, _ = sock.accept()
        held.append(conn)  # never answered, never closed
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

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Redirect)
    print(f"PORT {srv.server_port}", flush=True)
    srv.serve_forever()
