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
//
// With EXCHANGE_CLIENT_ID and EXCHANGE_CLIENT_SECRET as well (the token exchange tests): a
// token exchange grant (RFC 8693; oidc-provider has none built in, so it is registered here with
// `registerGrantType`) for that client only: the subject token must be an unexpired access token
// this provider issued (found with its own AccessToken model), and the token issued in exchange
// is a JWT access token for MCP_RESOURCE (the `resource` asked for), of the subject's account.
// Each exchange is a line `exchange <account> <resource>`, each refusal `exchange-error <why>`.
// With CLIENT_ID_METADATA_DOCUMENTS=1 as well: clients are named by their client ID metadata
// document's URL (oidc-provider's `clientIdMetadataDocument`, draft-02), and none are registered
// dynamically. Each document fetched is a line `metadata-document <url>`. oidc-provider refuses to
// fetch from special-use addresses (loopback among them); everything here is on loopback, so the
// fetch goes without that guard (NODE_EXTRA_CA_CERTS trusts the page's test certificate).
//
// `POST /test/subject?account=ID` answers a fresh opaque access token of that person (what a host
// holds for them; its audience is not the MCP server).
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

const documents = process.env.CLIENT_ID_METADATA_DOCUMENTS === '1';
const forResource = mcpResource ? {
  features: {
    devInteractions: { enabled: true },
    registration: { enabled: !documents },
    clientIdMetadataDocument: { enabled: documents, ack: documents ? 'draft-02' : undefined },
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
  ...(documents ? {
    fetch: (url, options) => {
      console.log(`metadata-document ${url}`);
      const { dispatcher, ...rest } = options;
      return globalThis.fetch(url, rest);
    },
  } : {}),
  scopes: ['openid', 'offline_access', 'mcp'],
} : {};

const TOKEN_EXCHANGE = 'urn:ietf:params:oauth:grant-type:token-exchange';
const exchangeClient = process.env.EXCHANGE_CLIENT_ID ? [{
  client_id: process.env.EXCHANGE_CLIENT_ID,
  client_secret: process.env.EXCHANGE_CLIENT_SECRET,
  redirect_uris: [],
  grant_types: [TOKEN_EXCHANGE],
  response_types: [],
  token_endpoint_auth_method: 'client_secret_basic',
}] : [];

const provider = new Provider(issuer, {
  clients: [...exchangeClient, {
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
    if (documents) console.log(`client ${ctx.oidc.client?.clientId}`);
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

if (mcpResource && process.env.EXCHANGE_CLIENT_ID) {
  const { errors } = await import(pathToFileURL(entry).href);
  const refuse = (why, error) => {
    console.log(`exchange-error ${why}`);
    throw error;
  };
  provider.registerGrantType(TOKEN_EXCHANGE, async (ctx) => {
    const { params } = ctx.oidc;
    if (params.subject_token_type !== 'urn:ietf:params:oauth:token-type:access_token') {
      refuse('subject_token_type', new errors.InvalidRequest('unsupported subject_token_type'));
    }
    if (params.resource !== mcpResource) {
      refuse('resource', new errors.InvalidTarget('unknown resource'));
    }
    const subject = await provider.AccessToken.find(String(params.subject_token || ''));
    if (!subject || subject.isExpired) {
      refuse('subject_token', new errors.InvalidGrant('subject token invalid or expired'));
    }
    const token = new provider.AccessToken({
      accountId: subject.accountId,
      client: ctx.oidc.client,
      grantId: subject.grantId,
      gty: 'token_exchange',
      scope: 'mcp',
    });
    token.resourceServer = new provider.ResourceServer(mcpResource, {
      scope: 'mcp',
      audience: mcpResource,
      accessTokenTTL: Number(process.env.RESOURCE_TTL || 3600),
      accessTokenFormat: 'jwt',
      jwt: { sign: { alg: 'RS256' } },
    });
    ctx.oidc.entity('AccessToken', token);
    const value = await token.save();
    console.log(`exchange ${subject.accountId} ${params.resource}`);
    ctx.body = {
      access_token: value,
      issued_token_type: 'urn:ietf:params:oauth:token-type:access_token',
      token_type: 'Bearer',
      expires_in: token.expiration,
      scope: 'mcp',
    };
  }, ['subject_token', 'subject_token_type', 'requested_token_type', 'resource', 'audience', 'scope'], ['resource']);
  provider.use(async (ctx, next) => {
    if (ctx.path === '/test/subject' && ctx.method === 'POST') {
      const account = String(ctx.query.account);
      const client = await provider.Client.find(process.env.CLIENT_ID);
      const grant = new provider.Grant({ clientId: client.clientId, accountId: account });
      grant.addOIDCScope('openid');
      const grantId = await grant.save();
      const token = new provider.AccessToken({
        accountId: account, client, grantId, gty: 'authorization_code', scope: 'openid',
      });
      ctx.body = await token.save();
      return undefined;
    }
    return next();
  });
}

provider.listen(port, '127.0.0.1', () => {
  console.log(`issuer ${issuer}`);
});
