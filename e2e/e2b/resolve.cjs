// Resolves every name under $FORKD_TEST_DOMAIN (default e2b.test) to
// 127.0.0.1 for Node's dns.lookup, which fetch and undici use: the E2B tests'
// resolver for <port>-<sandbox id>.<domain>, loaded with NODE_OPTIONS
// --require, so the SDKs stay unmodified and the host's resolver untouched.
const dns = require('node:dns')
const suffix = '.' + (process.env.FORKD_TEST_DOMAIN || 'e2b.test')
const orig = dns.lookup
dns.lookup = function (host, opts, cb) {
  if (typeof opts === 'function') { cb = opts; opts = {} }
  if (typeof host === 'string' && (host.endsWith(suffix) || host === suffix.slice(1))) {
    if (opts && opts.all) return process.nextTick(cb, null, [{ address: '127.0.0.1', family: 4 }])
    return process.nextTick(cb, null, '127.0.0.1', 4)
  }
  return orig.call(this, host, opts, cb)
}
