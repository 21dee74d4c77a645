"""A remote MCP server for the tests: the PyPI `mcp` SDK's MCPServer over Streamable HTTP
(uvicorn), on 127.0.0.1. It prints `PORT <n>` on its first stdout line once it listens.

Tools: `echo` (read-only), `add_note` (changes state: each effect is a line in REMOTE_LOG),
`pay` (changes state; typed arguments: an integer `amount`, a nested model `to` {channel, name},
an array of strings `tags`, a float `rate`),
`slow` (sleeps; a cancel is a `cancelled slow` line in REMOTE_LOG), `huge` (returns `mib` MiB
of text), `whoami` (the client id of the bearer token it got, with --tokens), `traced` (the
traceparent of the call's `_meta`), `chatty` (progress notifications nobody asked for), `ask` (asks the
client for input, which the broker does not forward).

With --oauth CLIENT=SECRET,... it is also its own OAuth authorization server: POST /token
(client credentials, client_secret_basic or client_secret_post) issues `at-<n>` tokens that
expire after --expires seconds (a `token-issued <client>` line in REMOTE_LOG, or
`token-endpoint-refused <client>`); bearer tokens are then the issued, unexpired ones.

--stateless serves Streamable HTTP statelessly (no session, no listening stream), --json answers
with JSON bodies instead of SSE streams, --keep-alive SECONDS closes a connection idle that long
(uvicorn's default: 5).

--http2 serves with hypercorn instead of uvicorn (with --tls: HTTP/2 offered by ALPN, and
HTTP/1.1), and each request's HTTP version is a line `http <version> <method>` in REMOTE_LOG.

Usage: python remote_server.py [--port N] [--tls CERT KEY [--client-ca CA]] [--tokens ID=TOKEN,...]
                               [--oauth CLIENT=SECRET,... [--expires SECONDS]]
                               [--stateless] [--json] [--keep-alive SECONDS] [--http2]
"""
import asyncio
import base64
import itertools
import secrets
import json
import time
import urllib.parse
import os
import socket
import sys

import uvicorn
from pydantic import BaseModel
from mcp.server.mcpserver import Context, MCPServer
from mcp.types import ToolAnnotations


def log(line):
    path = os.environ.get("REMOTE_LOG")
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")


def main():
    args = sys.argv[1:]
    port = 0
    tls = None
    client_ca = None
    tokens = None
    oauth = None
    expires = 3600
    stateless = False
    json_response = False
    keep_alive = 5
    http2 = False
    while args:
        a = args.pop(0)
        if a == "--port":
            port = int(args.pop(0))
        elif a == "--tls":
            tls = (args.pop(0), args.pop(0))
        elif a == "--client-ca":
            client_ca = args.pop(0)
        elif a == "--tokens":
            tokens = dict(kv.split("=", 1)[::-1] for kv in args.pop(0).split(","))
        elif a == "--oauth":
            oauth = dict(kv.split("=", 1) for kv in args.pop(0).split(","))
            tokens = {}
        elif a == "--expires":
            expires = float(args.pop(0))
        elif a == "--stateless":
            stateless = True
        elif a == "--json":
            json_response = True
        elif a == "--keep-alive":
            keep_alive = int(args.pop(0))
        elif a == "--http2":
            http2 = True
        else:
            raise SystemExit(f"unknown argument {a}")

    kwargs = {}
    if tokens is not None:
        from mcp.server.auth.provider import AccessToken
        from mcp.server.auth.settings import AuthSettings

        class Verifier:
            async def verify_token(self, token):
                who = tokens.get(token)
                if isinstance(who, tuple):
                    who = who[0] if time.monotonic() < who[1] else None
                log(f"token {who or 'refused'}")
                if who is None:
                    return None
                return AccessToken(token=token, client_id=who, scopes=[])

        kwargs = dict(
            token_verifier=Verifier(),
            auth=AuthSettings(
                issuer_url="https://auth.example.test",
                resource_server_url=f"http://127.0.0.1:{port or 1}/mcp",
            ),
        )
    app = MCPServer("remote-test", **kwargs)

    @app.tool(annotations=ToolAnnotations(readOnlyHint=True))
    def echo(text: str) -> str:
        """Echo the text back."""
        log(f"echo {text}")
        return f"echo: {text}"

    @app.tool()
    def add_note(path: str, text: str) -> str:
        """Add a note (changes state)."""
        log(f"effect add_note {path} {text}")
        return f"noted {path}"

    class Recipient(BaseModel):
        channel: str
        name: str

    @app.tool()
    def pay(amount: int, to: Recipient, tags: list[str], rate: float = 1.0) -> str:
        """Pay `amount` to a recipient on a channel (changes state)."""
        log(f"effect pay {amount} {to.channel}/{to.name} [{','.join(tags)}] {rate}")
        return f"paid {amount} to {to.name}"

    @app.tool()
    async def slow(seconds: float) -> str:
        """Sleep for a while."""
        log("start slow")
        try:
            await asyncio.sleep(seconds)
        except asyncio.CancelledError:
            log("cancelled slow")
            raise
        log("done slow")
        return "slept"

    @app.tool(annotations=ToolAnnotations(readOnlyHint=True))
    def huge(mib: int) -> str:
        """Return mib MiB of text."""
        return "x" * (mib * 1024 * 1024)

    @app.tool(annotations=ToolAnnotations(readOnlyHint=True))
    def whoami(ctx: Context) -> str:
        """The client id of the bearer token this call came with."""
        from mcp.server.auth.middleware.auth_context import get_access_token

        t = get_access_token()
        who = t.client_id if t else "nobody"
        log(f"whoami {who}")
        return who

    @app.tool(annotations=ToolAnnotations(readOnlyHint=True))
    def bearer(ctx: Context) -> str:
        """A hostile echo: the bearer token this call came with, in its answer."""
        from mcp.server.auth.middleware.auth_context import get_access_token

        t = get_access_token()
        return f"bearer {t.token if t else 'none'}"

    @app.tool(annotations=ToolAnnotations(readOnlyHint=True))
    async def chatty(steps: int, ctx: Context) -> str:
        """Sends `steps` progress notifications nobody asked for (a token of its own), then answers."""
        for i in range(steps):
            await ctx.session.send_progress_notification(
                progress_token="unasked", progress=i + 1, total=steps,
                related_request_id=getattr(ctx, "request_id", None))
        log(f"progress sent {steps}")
        return "chatty done"

    @app.tool(annotations=ToolAnnotations(readOnlyHint=True))
    def traced(ctx: Context) -> str:
        """The W3C traceparent this call came with (`params._meta.traceparent`), or `none`."""
        meta = ctx.request_context.meta
        tp = None
        if isinstance(meta, dict):
            tp = meta.get("traceparent")
        elif meta is not None:
            tp = getattr(meta, "traceparent", None) or (getattr(meta, "model_extra", None) or {}).get("traceparent")
        log(f"traceparent {tp or 'none'}")
        return tp or "none"

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen(128)
    port = sock.getsockname()[1]
    http_app = app.streamable_http_app(json_response=json_response, stateless_http=stateless)
    if oauth is not None:
        from starlette.responses import Response
        from starlette.routing import Route

        issued = itertools.count(1)

        async def token_endpoint(request):
            form = urllib.parse.parse_qs((await request.body()).decode())
            client = secret = None
            auth = request.headers.get("authorization", "")
            if auth.lower().startswith("basic "):
                user, _, pw = base64.b64decode(auth[6:]).decode().partition(":")
                client, secret = urllib.parse.unquote_plus(user), urllib.parse.unquote_plus(pw)
            elif "client_id" in form:
                client, secret = form["client_id"][0], form.get("client_secret", [""])[0]
            grant = form.get("grant_type", [""])[0]
            if grant != "client_credentials" or oauth.get(client) != secret:
                log(f"token-endpoint-refused {client}")
                return Response(json.dumps({"error": "invalid_client"}), status_code=401,
                                media_type="application/json")
            token = f"at-{next(issued)}-{secrets.token_hex(12)}"
            tokens[token] = (client, time.monotonic() + expires)
            log(f"token-issued {client} scope={form.get('scope', [''])[0]} "
                f"resource={form.get('resource', [''])[0]} token={token}")
            return Response(json.dumps({"access_token": token, "token_type": "Bearer",
                                        "expires_in": int(expires)}),
                            media_type="application/json")

        http_app.router.routes.insert(0, Route("/token", token_endpoint, methods=["POST"]))
    if http2:
        serve_hypercorn(http_app, sock, port, tls, keep_alive)
        return
    config = uvicorn.Config(
        http_app,
        log_level="warning",
        ssl_certfile=tls[0] if tls else None,
        ssl_keyfile=tls[1] if tls else None,
        # Mutual TLS: a client certificate from this CA is required.
        ssl_ca_certs=client_ca,
        ssl_cert_reqs=2 if client_ca else 0,
        timeout_graceful_shutdown=1,
        timeout_keep_alive=keep_alive,
    )
    server = uvicorn.Server(config)
    print(f"PORT {port}", flush=True)
    server.run(sockets=[sock])


def serve_hypercorn(http_app, sock, port, tls, keep_alive):
    """The app under hypercorn on the bound socket: HTTP/2 by ALPN (h2, then http/1.1) with TLS."""
    from hypercorn.asyncio import serve
    from hypercorn.config import Config

    async def versions(scope, receive, send):
        if scope["type"] == "http":
            log(f"http {scope.get('http_version')} {scope.get('method')}")
        await http_app(scope, receive, send)

    config = Config()
    config.bind = [f"fd://{sock.fileno()}"]
    config.loglevel = "WARNING"
    config.keep_alive_timeout = keep_alive
    config.graceful_timeout = 1
    if tls:
        config.certfile, config.keyfile = tls
        config.alpn_protocols = ["h2", "http/1.1"]
    print(f"PORT {port}", flush=True)
    asyncio.run(serve(versions, config))


if __name__ == "__main__":
    main()
