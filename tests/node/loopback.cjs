// A preload for tests (`node -r loopback.cjs server.js`): every TCP server the process starts
// listens on 127.0.0.1 only. npm server-everything's `streamableHttp` mode calls
// `app.listen(PORT)`, which binds every interface, and has no setting for the host; the tests
// must not listen beyond loopback. The server's own code is not changed.
"use strict";
const net = require("net");
const listen = net.Server.prototype.listen;
net.Server.prototype.listen = function (...args) {
  const cb = args.find((a) => typeof a === "function");
  const first = args[0];
  if (typeof first === "number" || (typeof first === "string" && /^\d+$/.test(first))) {
    return listen.call(this, { port: Number(first), host: "127.0.0.1" }, cb);
  }
  if (first && typeof first === "object" && first.path === undefined) {
    return listen.call(this, { ...first, host: "127.0.0.1" }, cb);
  }
  return listen.apply(this, args);
};
