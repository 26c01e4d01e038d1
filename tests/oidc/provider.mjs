// A real OpenID Connect provider (panva's oidc-provider, OpenID Certified) on loopback, for
// proofplane's SSO tests. Not for production: accounts are fixed, storage is in memory and the
// login form is the library's development interaction (any password is accepted).
//
//   node tests/oidc/provider.mjs --port 4444 --client-id proofplane --client-secret s3cret \
//        --redirect-uri http://127.0.0.1:8000/api/v1/auth/oidc/callback
//
// Options fall back to OIDC_PORT, OIDC_CLIENT_ID, OIDC_CLIENT_SECRET, OIDC_REDIRECT_URI.
// --redirect-uri may be given several times. On start it prints one line,
// "oidc-provider listening on <issuer>", and serves <issuer>/.well-known/openid-configuration.

import { generateKeyPairSync, randomBytes } from 'node:crypto';
import { parseArgs } from 'node:util';

import Provider from 'oidc-provider';

const { values } = parseArgs({
  options: {
    port: { type: 'string', default: process.env.OIDC_PORT },
    host: { type: 'string', default: '127.0.0.1' },
    'client-id': { type: 'string', default: process.env.OIDC_CLIENT_ID },
    'client-secret': { type: 'string', default: process.env.OIDC_CLIENT_SECRET },
    'redirect-uri': {
      type: 'string',
      multiple: true,
      default: process.env.OIDC_REDIRECT_URI ? [process.env.OIDC_REDIRECT_URI] : [],
    },
  },
});

for (const name of ['port', 'client-id', 'client-secret']) {
  if (!values[name]) {
    console.error(`provider.mjs: --${name} is required`);
    process.exit(2);
  }
}
if (values['redirect-uri'].length === 0) {
  console.error('provider.mjs: at least one --redirect-uri is required');
  process.exit(2);
}

// The test accounts: the account id is what the login form takes.
const ACCOUNTS = {
  alice: { name: 'Alice Admin', email: 'alice@example.test', groups: ['pp-admins'] },
  bob: { name: 'Bob Developer', email: 'bob@example.test', groups: ['clinic-devs'] },
  carol: { name: 'Carol Unmapped', email: 'carol@example.test', groups: ['unmapped'] },
  dave: { name: 'Dave Both', email: 'dave@example.test', groups: ['clinic-devs', 'auditors', 'unmapped'] },
};

// A fresh RS256 signing key per process; the public half is served at the JWKS endpoint.
const { privateKey } = generateKeyPairSync('rsa', { modulusLength: 2048 });
const signingKey = {
  ...privateKey.export({ format: 'jwk' }),
  kid: `test-${randomBytes(4).toString('hex')}`,
  alg: 'RS256',
  use: 'sig',
};

const issuer = `http://${values.host}:${values.port}`;

const provider = new Provider(issuer, {
  clients: [
    {
      client_id: values['client-id'],
      client_secret: values['client-secret'],
      redirect_uris: values['redirect-uri'],
      grant_types: ['authorization_code'],
      response_types: ['code'],
      token_endpoint_auth_method: 'client_secret_basic',
      id_token_signed_response_alg: 'RS256',
    },
  ],
  // PKCE (S256, the only method this library supports) for every client, confidential ones too.
  pkce: { required: () => true },
  claims: {
    openid: ['sub'],
    profile: ['preferred_username', 'name'],
    email: ['email', 'email_verified'],
    groups: ['groups'],
  },
  async findAccount(_ctx, id) {
    const account = ACCOUNTS[id];
    if (!account) return undefined;
    return {
      accountId: id,
      async claims() {
        return {
          sub: id,
          preferred_username: id,
          name: account.name,
          email: account.email,
          email_verified: true,
          groups: account.groups,
        };
      },
    };
  },
  jwks: { keys: [signingKey] },
  cookies: { keys: [randomBytes(32).toString('hex')] },
  features: {
    devInteractions: { enabled: true }, // the library's own login + consent pages
    userinfo: { enabled: true },
  },
});

provider.on('server_error', (_ctx, err) => console.error('oidc-provider server_error:', err));

provider.listen(Number(values.port), values.host, () => {
  console.log(`oidc-provider listening on ${issuer}`);
});

for (const signal of ['SIGTERM', 'SIGINT']) {
  process.on(signal, () => process.exit(0));
}
