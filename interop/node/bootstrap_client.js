#!/usr/bin/env node
// A BootstrapService client in JavaScript, built from nothing but ../../protos/.
//
//   node bootstrap_client.js HOST:PORT
//
// Checks health (grpc.health.v1), registers a batch of rooms (uint64 ids, some with
// rank 0), queries them plus unknown rooms, and checks the error codes for room 0 and
// for a room re-registered with another rank. Prints one JSON line with what it saw and
// exits 0 when every answer was the expected one, 1 otherwise.
"use strict";

const path = require("path");
const crypto = require("crypto");
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");

const PROTOS = path.resolve(__dirname, "..", "..", "protos");
const address = process.argv[2];
if (!address) {
  console.error("usage: node bootstrap_client.js HOST:PORT");
  process.exit(2);
}

const definition = protoLoader.loadSync(["pdgrpc/v1/bootstrap.proto", "grpc/health/v1/health.proto"], {
  includeDirs: [PROTOS],
  keepCase: true,
  longs: String, // uint64 room ids do not fit a JS number: strings on the way in and out
  enums: String,
  defaults: true,
});
const loaded = grpc.loadPackageDefinition(definition);
const credentials = grpc.credentials.createInsecure();
const bootstrap = new loaded.pdgrpc.v1.BootstrapService(address, credentials);
const health = new loaded.grpc.health.v1.Health(address, credentials, { channelOverride: bootstrap.getChannel() });

function call(client, method, request) {
  const deadline = new Date(Date.now() + 5000);
  return new Promise((resolve, reject) => {
    client[method](request, { deadline }, (err, reply) => (err ? reject(err) : resolve(reply)));
  });
}

async function expectError(promise, code) {
  try {
    await promise;
  } catch (err) {
    if (err.code === code) return err.details;
    throw new Error(`expected status ${code}, got ${err.code}: ${err.details}`);
  }
  throw new Error(`expected status ${code}, got OK`);
}

function randomRoom() {
  // Random 63-bit id, never 0, as a decimal string.
  return ((crypto.randomBytes(8).readBigUInt64BE() >> 1n) | 1n).toString();
}

function check(condition, what) {
  if (!condition) throw new Error(`check failed: ${what}`);
}

async function main() {
  const seen = {};
  const overall = await call(health, "Check", { service: "" });
  const service = await call(health, "Check", { service: "pdgrpc.v1.BootstrapService" });
  seen.health = [overall.status, service.status];
  check(overall.status === "SERVING" && service.status === "SERVING", "health is SERVING");

  const ranks = new Map();
  for (let i = 0; i < 100; i++) ranks.set(randomRoom(), i % 4); // a quarter have rank 0
  ranks.set("18446744073709551615", 1); // the largest uint64
  const entries = [...ranks].map(([bootstrap_room, dp_rank]) => ({ bootstrap_room, dp_rank }));
  const registered = await call(bootstrap, "RegisterDpRanks", { entries });
  seen.registered = { added: registered.added, unchanged: registered.unchanged };
  check(registered.added === ranks.size && registered.unchanged === 0, "all rooms added");

  const unknown = [randomRoom(), randomRoom()];
  const asked = [...ranks.keys(), ...unknown];
  const answer = await call(bootstrap, "QueryDpRanks", { bootstrap_rooms: asked });
  seen.found = answer.entries.length;
  seen.missing = answer.missing_rooms.length;
  check(answer.entries.length === ranks.size, "every registered room found");
  for (const e of answer.entries) check(ranks.get(e.bootstrap_room) === e.dp_rank, `rank of room ${e.bootstrap_room}`);
  check(JSON.stringify([...answer.missing_rooms].sort()) === JSON.stringify([...unknown].sort()), "unknown rooms missing");

  const again = await call(bootstrap, "RegisterDpRanks", { entries: entries.slice(0, 3) });
  check(again.added === 0 && again.unchanged === 3, "re-registering the same rank is idempotent");
  const [room, rank] = [...ranks][0];
  seen.conflict = await expectError(
    call(bootstrap, "RegisterDpRanks", { entries: [{ bootstrap_room: room, dp_rank: rank + 1 }] }),
    grpc.status.ALREADY_EXISTS,
  );
  check(seen.conflict.includes(room), "the conflict names the room");
  seen.room_zero = await expectError(
    call(bootstrap, "RegisterDpRanks", { entries: [{ bootstrap_room: "0", dp_rank: 1 }] }),
    grpc.status.INVALID_ARGUMENT,
  );
  console.log(JSON.stringify({ ok: true, ...seen }));
}

main()
  .then(() => process.exit(0))
  .catch((err) => {
    console.log(JSON.stringify({ ok: false, error: String(err && err.stack ? err.stack : err) }));
    process.exit(1);
  });
