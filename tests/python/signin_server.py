"""A remote MCP server that accepts only its people's own tokens (issue 45, signing in to remote
servers): the PyPI `mcp` SDK's MCPServer over Streamable HTTP on 127.0.0.1, whose token verifier
takes a JWT access token only when the OpenID provider at ISSUER signed it (its JWKS) for this
server's own audience (its URL, the RFC 8707 resource), unexpired, with scope `mcp`. Its 401 names
its protected resource metadata (RFC 9728), which names ISSUER as its authorization server.

Tools: `whoami` (the subject of the token the call came with), `echo`.
Log (REMOTE_LOG): `token <sub>` or `token refused <why>` per request, `whoami <sub>` per call.
TOKENS_SEEN (tests only): a file each accepted token is appended to, for the test to search the
broker's record and log for them. REVOKED (tests only): a file of tokens refused though valid
(`token refused revoked`), as a server that revoked them would.

Usage: python signin_server.py PORT ISSUER. Prints `PORT <n>` once it listens.
"""
import os
import socket
import sys

import jwt
import uvicorn
from mcp.server.auth.middleware.auth_context import get_access_token
from mcp.server.auth.provider import AccessToken
from mcp.server.auth.settings import AuthSettings
from mcp.server.mcpserver import MCPServer
from mcp.types import ToolAnnotations

port, issuer = int(sys.argv[1]), sys.argv[2]
resource = f"http://127.0.0.1:{port}/mcp"
keys = jwt.PyJWKClient(f"{issuer}/jwks")


def log(line):
    path = os.environ.get("REMOTE_LOG")
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")


class Verifier:
    async def verify_token(self, token):
        revoked = os.environ.get("REVOKED")
        if revoked and os.path.exists(revoked):
            with open(revoked) as f:
                if token in f.read().split():
                    log("token refused revoked")
                    return None
        try:
            key = keys.get_signing_key_from_jwt(token)
            claims = jwt.decode(token, key.key, algorithms=["RS256", "PS256", "ES256"],
                                audience=resource, issuer=issuer)
        except Exception as e:  # any failure is a refusal, said in the log
            log(f"token refused {type(e).__name__}")
            return None
        scopes = claims.get("scope", "").split()
        if "mcp" not in scopes:
            log("token refused scope")
            return None
        log(f"token {claims['sub']}")
        seen = os.environ.get("TOKENS_SEEN")
        if seen:
            with open(seen, "a") as f:
                f.write(token + "\n")
        return AccessToken(token=token, client_id=claims.get("client_id", "?"), scopes=scopes,
                           expires_at=claims.get("exp"), subject=claims["sub"])


app = MCPServer(
    "signin-test",
    token_verifier=Verifier(),
    auth=AuthSettings(issuer_url=issuer, resource_server_url=resource, required_scopes=["mcp"]),
)


@app.tool(annotations=ToolAnnotations(readOnlyHint=True))
def whoami() -> str:
    """Who the token of this call belongs to (its subject)."""
    token = get_access_token()
    who = getattr(token, "subject", None) or "?"
    log(f"whoami {who}")
    return who


@app.tool(annotations=ToolAnnotations(readOnlyHint=True))
def echo(text: str) -> str:
    """Echo the text back."""
    return f"echo: {text}"


sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
sock.bind(("127.0.0.1", port))
sock.listen(128)
server = uvicorn.Server(uvicorn.Config(app.streamable_http_app(), log_level="warning",
                                       timeout_graceful_shutdown=1))
print(f"PORT {port}", flush=True)
server.run(sockets=[sock])
