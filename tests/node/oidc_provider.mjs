// A real OpenID provider for the person's page tests (issue 45): npm oidc-provider (panva, OpenID
// certified), on loopback, with two people, alice and bob, signed in at its own development login
// page (any password); `sub` and `preferred_username` are their names.
//
// Env: OIDC_NODE_PATH (the node_modules folder oidc-provider is in, .ci/install-browser), PORT,
// CLIENT_ID, CLIENT_SECRET, REDIRECT_URI. Prints `issuer <url>` once it listens.
import path from 'node:path';
import { pathToFileURL } from 'node:url';

const entry = path.join(process.env.OIDC_NODE_PATH, 'oidc-provider', 'lib', 'index.js');
const { default: Provider } = await import(pathToFileURL(entry).href);

const port = Number(process.env.PORT);
const issuer = `http://127.0.0.1:${port}`;
const people = new Set(['alice', 'bob']);

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
  async findAccount(ctx, id) {
    // The development login takes any login name: only alice's and bob's are people here.
    if (!people.has(id)) return undefined;
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
    await grant.save();
    return grant;
  },
});

provider.listen(port, '127.0.0.1', () => {
  console.log(`issuer ${issuer}`);
});
