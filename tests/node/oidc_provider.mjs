// A real OpenID provider for the person's page tests (issue 45): npm oidc-provider (panva, OpenID
// certified), on loopback, with two people, alice and bob, signed in at its own development login
// page (any password); `sub` and `preferred_username` are their names.
//
// Env: OIDC_NODE_PATH (the node_modules folder oidc-provider is in, .ci/install-browser), PORT,
// CLIENT_ID, CLIENT_SECRET, REDIRECT_URI. Prints `issuer <url>` once it listens.
//
// With MCP_RESOURCE (a remote MCP server's URL; the sign-in tests): also the authorization server
// of that server. It issues JWT access tokens for that resource only (RFC 8707, scope `mcp`,
// audience the resource, lifetime RESOURCE_TTL seconds, default 3600) and refresh tokens, and
// registers clients dynamically (RFC 7591). Each token grant is a line on stdout (`grant
// <grant_type> <account> <page|mcp>`, the page's client or another, or `grant-error <grant_type> <error>`). `POST /test/revoke?account=ID`
// revokes that person's refresh tokens (their next refresh is refused `invalid_grant`).
import path from 'node:path';
import { pathToFileURL } from 'node:url';

const entry = path.join(process.env.OIDC_NODE_PATH, 'oidc-provider', 'lib', 'index.js');
const { default: Provider } = await import(pathToFileURL(entry).href);

const port = Number(process.env.PORT);
const issuer = `http://127.0.0.1:${port}`;
const people = new Set(['alice', 'bob']);
const mcpResource = process.env.MCP_RESOURCE;
// People whose refresh tokens were revoked (POST /test/revoke).
const revoked = new Set();

const forResource = mcpResource ? {
  features: {
    devInteractions: { enabled: true },
    registration: { enabled: true },
    resourceIndicators: {
      enabled: true,
      defaultResource: (ctx, client, oneOf) => oneOf ?? mcpResource,
      useGrantedResource: () => true,
      getResourceServerInfo(ctx, resourceIndicator) {
        if (resourceIndicator !== mcpResource) throw new Error(`unknown resource ${resourceIndicator}`);
        return {
          scope: 'mcp',
          audience: resourceIndicator,
          accessTokenTTL: Number(process.env.RESOURCE_TTL || 3600),
          accessTokenFormat: 'jwt',
          jwt: { sign: { alg: 'RS256' } },
        };
      },
    },
  },
  issueRefreshToken: async (ctx, client) => client.grantTypeAllowed('refresh_token'),
  scopes: ['openid', 'offline_access', 'mcp'],
} : {};

const provider = new Provider(issuer, {
  clients: [{
    client_id: process.env.CLIENT_ID,
    client_secret: process.env.CLIENT_SECRET,
    redirect_uris: [process.env.REDIRECT_URI],
    grant_types: ['authorization_code'],
    response_types: ['code'],
    token_endpoint_auth_method: 'client_secret_basic',
  }],
  pkce: { required: () => true },
  claims: { openid: ['sub'], profile: ['preferred_username'] },
  // The profile claims in the ID token itself, as the page reads the principal from it.
  conformIdTokenClaims: false,
  features: { devInteractions: { enabled: true } },
  ...forResource,
  async findAccount(ctx, id) {
    // The development login takes any login name: only alice's and bob's are people here.
    if (!people.has(id)) return undefined;
    // A revoked person's refresh token names an account that is gone for it.
    if (revoked.has(id) && ctx?.oidc?.params?.grant_type === 'refresh_token') return undefined;
    return {
      accountId: id,
      async claims() {
        return { sub: id, preferred_username: id };
      },
    };
  },
  // First-party: no consent screen after the login.
  async loadExistingGrant(ctx) {
    const grantId = ctx.oidc.result?.consent?.grantId
      || ctx.oidc.session.grantIdFor(ctx.oidc.client.clientId);
    if (grantId) return ctx.oidc.provider.Grant.find(grantId);
    const grant = new ctx.oidc.provider.Grant({
      clientId: ctx.oidc.client.clientId,
      accountId: ctx.oidc.session.accountId,
    });
    grant.addOIDCScope('openid profile');
    grant.addOIDCClaims(['preferred_username']);
    // A sign-in to the MCP server (a resource, RFC 8707): its scope for it, granted too.
    const resource = ctx.oidc.params.resource;
    if (mcpResource && resource) {
      grant.addResourceScope(resource, String(ctx.oidc.params.scope || 'mcp'));
    }
    await grant.save();
    return grant;
  },
});

if (mcpResource) {
  provider.on('grant.success', (ctx) => {
    const account = ctx.oidc.account?.accountId ?? ctx.oidc.entities?.RefreshToken?.accountId ?? '';
    const client = ctx.oidc.client?.clientId === process.env.CLIENT_ID ? 'page' : 'mcp';
    console.log(`grant ${ctx.oidc.params.grant_type} ${account} ${client}`);
  });
  provider.on('grant.error', (ctx, error) => {
    console.log(`grant-error ${ctx.oidc.params?.grant_type} ${error.error}`);
  });
  provider.use(async (ctx, next) => {
    if (ctx.path === '/test/revoke' && ctx.method === 'POST') {
      revoked.add(String(ctx.query.account));
      ctx.body = 'revoked';
      return undefined;
    }
    return next();
  });
}

provider.listen(port, '127.0.0.1', () => {
  console.log(`issuer ${issuer}`);
});
