package ledger

import "github.com/redis/go-redis/v9"

// Lua scripts of the Redis backend, one per atomic step. Every script touches
// the keys of exactly one hash slot, all passed in KEYS (Redis Cluster).
//
// An operation is a hash at <prefix>:{<op-key>}:op with these fields:
//
//	rec    the record as JSON, written by Go; the fields below override it
//	id     operation id
//	phase  waiting | succeeded | stopped | escalated | closed
//	dl     deadline, unix microseconds (0 = none)
//	np     next_poll_at, unix microseconds (0 = none)
//	max    status request budget
//	used   status requests used (owned by Reserve, never decreases)
//	early  early polls (owned by Reserve)
//	fence  lease fence; holder, lexp (expiry, unix us, 0 = released), lexpt (expiry, RFC 3339)
//	upd    updated_at (RFC 3339); updus the same in unix microseconds
//	acount audit chain length; ahead audit chain head (hex)
//
// and its audit chain is a list of envelope JSON at <prefix>:{<op-key>}:audit.
// Times are compared at microsecond precision. Audit hashes are computed in
// Go (Redis Lua has no SHA-256): writers pass the chain position they sealed
// against and the script compares-and-sets it; on "moved" Go re-seals and
// retries.

// luaTerminal is shared by the scripts that test for a terminal phase.
const luaTerminal = `local TERMINAL = {succeeded=true, stopped=true, escalated=true, closed=true}
`

// reserveScript is the poll gate (R9, R21).
//
//	KEYS[1] operation hash
//	ARGV[1] now (unix us)        ARGV[2] lease expiry (unix us)
//	ARGV[3] lease expiry (text)  ARGV[4] holder
//	ARGV[5] now (text)
//
// Returns {"not_found"} or {outcome, HGETALL...} with outcome one of
// terminal, deadline_reached, budget_exhausted, too_early, busy, reserved;
// too_early and busy count one early poll.
var reserveScript = redis.NewScript(luaTerminal + `
local f = redis.call('HMGET', KEYS[1], 'phase', 'dl', 'used', 'max', 'np', 'lexp', 'fence')
if not f[1] then return {'not_found'} end
local now = tonumber(ARGV[1])
local dl, used, max = tonumber(f[2]), tonumber(f[3]), tonumber(f[4])
local np, lexp, fence = tonumber(f[5]), tonumber(f[6]), tonumber(f[7])
local outcome
if TERMINAL[f[1]] then
  outcome = 'terminal'
elseif dl > 0 and now >= dl then
  outcome = 'deadline_reached'
elseif used >= max then
  outcome = 'budget_exhausted'
elseif now < np or (lexp > 0 and now < lexp) then
  if now < np then outcome = 'too_early' else outcome = 'busy' end
  redis.call('HINCRBY', KEYS[1], 'early', 1)
  redis.call('HSET', KEYS[1], 'upd', ARGV[5], 'updus', ARGV[1])
else
  outcome = 'reserved'
  redis.call('HSET', KEYS[1], 'used', used + 1, 'fence', fence + 1, 'holder', ARGV[4],
    'lexp', ARGV[2], 'lexpt', ARGV[3], 'upd', ARGV[5], 'updus', ARGV[1])
end
local r = redis.call('HGETALL', KEYS[1])
table.insert(r, 1, outcome)
return r
`)

// addEarlyScript counts several early polls of one operation at once.
//
//	KEYS[1] operation hash
//	ARGV[1] n  ARGV[2] now (unix us)  ARGV[3] now (text)
//
// Returns {"not_found"} or {"ok", early}.
var addEarlyScript = redis.NewScript(`
if redis.call('EXISTS', KEYS[1]) == 0 then return {'not_found'} end
local early = redis.call('HINCRBY', KEYS[1], 'early', tonumber(ARGV[1]))
if tonumber(redis.call('HGET', KEYS[1], 'updus') or '0') < tonumber(ARGV[2]) then
  redis.call('HSET', KEYS[1], 'upd', ARGV[3], 'updus', ARGV[2])
end
return {'ok', tostring(early)}
`)

// luaCheckAudit is shared by the writing scripts: it checks the audit
// position the entry was sealed against (ARGV[1] count, ARGV[2] head) and,
// if another step appended meanwhile, returns {"moved", HGETALL...}.
const luaCheckAudit = `
local a = redis.call('HMGET', KEYS[1], 'acount', 'ahead')
if a[1] ~= ARGV[1] or a[2] ~= ARGV[2] then
  local r = redis.call('HGETALL', KEYS[1])
  table.insert(r, 1, 'moved')
  return r
end
`

// luaDone returns {"ok", HGETALL...}: the record as committed.
const luaDone = `
local r = redis.call('HGETALL', KEYS[1])
table.insert(r, 1, 'ok')
return r
`

// luaWrite stores the record fields, appends the envelope, and sets the
// retention expiry (or removes it) on both keys. Expects ARGV[1..12]:
//
//	ARGV[1] audit count sealed against  ARGV[2] audit head sealed against
//	ARGV[3] rec JSON  ARGV[4] phase  ARGV[5] deadline us  ARGV[6] next poll us
//	ARGV[7] max       ARGV[8] updated text  ARGV[9] updated us
//	ARGV[10] envelope JSON  ARGV[11] new audit head  ARGV[12] retention ms (0 = keep)
const luaWrite = `
redis.call('HSET', KEYS[1], 'rec', ARGV[3], 'phase', ARGV[4], 'dl', ARGV[5], 'np', ARGV[6],
  'max', ARGV[7], 'upd', ARGV[8], 'updus', ARGV[9], 'acount', tonumber(ARGV[1]) + 1, 'ahead', ARGV[11])
redis.call('RPUSH', KEYS[2], ARGV[10])
if tonumber(ARGV[12]) > 0 then
  redis.call('PEXPIRE', KEYS[1], ARGV[12])
  redis.call('PEXPIRE', KEYS[2], ARGV[12])
else
  redis.call('PERSIST', KEYS[1])
  redis.call('PERSIST', KEYS[2])
end
`

// completeScript commits a reservation's result and releases the lease.
//
//	KEYS[1] operation hash  KEYS[2] audit list
//	ARGV[1..12] (see luaWrite)
//	ARGV[13] fence of the reservation  ARGV[14] status requests used per the caller
//
// Returns {"not_found"}, {"fence_lost", fence}, {"phase_changed", phase},
// {"moved", HGETALL...} or {"ok", used, early} (a short reply: this is half
// of every governed status call).
var completeScript = redis.NewScript(`
local f = redis.call('HMGET', KEYS[1], 'fence', 'lexp', 'phase', 'used')
if not f[3] then return {'not_found'} end
if f[1] ~= ARGV[13] or tonumber(f[2]) == 0 then return {'fence_lost', f[1]} end
if f[3] ~= 'waiting' then return {'phase_changed', f[3]} end
` + luaCheckAudit + luaWrite + `
local used = math.max(tonumber(f[4]), tonumber(ARGV[14]))
redis.call('HSET', KEYS[1], 'used', used, 'holder', '', 'lexp', 0, 'lexpt', '')
return {'ok', tostring(used), redis.call('HGET', KEYS[1], 'early')}
`)

// escalateScript commits an escalation decided without a reservation, only
// while the phase is waiting and no live lease is held.
//
//	KEYS[1] operation hash  KEYS[2] audit list
//	ARGV[1..12] (see luaWrite)
//	ARGV[13] now (unix us)  ARGV[14] status requests used per the caller
//
// Returns {"not_found"}, {"noop", HGETALL...}, {"moved", HGETALL...} or {"ok", HGETALL...}.
var escalateScript = redis.NewScript(`
local f = redis.call('HMGET', KEYS[1], 'phase', 'lexp', 'used')
if not f[1] then return {'not_found'} end
local lexp = tonumber(f[2])
if f[1] ~= 'waiting' or (lexp > 0 and tonumber(ARGV[13]) < lexp) then
  local r = redis.call('HGETALL', KEYS[1])
  table.insert(r, 1, 'noop')
  return r
end
` + luaCheckAudit + luaWrite + `
redis.call('HSET', KEYS[1], 'used', math.max(tonumber(f[3]), tonumber(ARGV[14])))
` + luaDone)

// updateScript commits an admin read-modify-write; the fields owned by
// Reserve (used, early, lease) are kept as stored.
//
//	KEYS[1] operation hash  KEYS[2] audit list
//	ARGV[1..12] (see luaWrite)
//
// Returns {"not_found"}, {"moved", HGETALL...} or {"ok", HGETALL...}.
var updateScript = redis.NewScript(`
if redis.call('EXISTS', KEYS[1]) == 0 then return {'not_found'} end
` + luaCheckAudit + luaWrite + luaDone)

// createScript stores a new operation unless one exists for its key.
//
//	KEYS[1] operation hash  KEYS[2] audit list
//	ARGV[1] "0" ARGV[2] "" (audit position of an empty chain), ARGV[3..12] (see luaWrite)
//	ARGV[13] id  ARGV[14] used  ARGV[15] early  ARGV[16] fence
//	ARGV[17] holder  ARGV[18] lease expiry us  ARGV[19] lease expiry text
//
// Returns {"exists", HGETALL...} or {"created"}.
var createScript = redis.NewScript(`
if redis.call('EXISTS', KEYS[1]) == 1 then
  local r = redis.call('HGETALL', KEYS[1])
  table.insert(r, 1, 'exists')
  return r
end
redis.call('HSET', KEYS[1], 'id', ARGV[13], 'used', ARGV[14], 'early', ARGV[15], 'fence', ARGV[16],
  'holder', ARGV[17], 'lexp', ARGV[18], 'lexpt', ARGV[19])
` + luaWrite + `
return {'created'}
`)

// indexScript claims an operation id and registers the operation for List
// and FindSubmission. All index keys share the {idx} hash tag.
//
//	KEYS[1] id key  KEYS[2] registry (sorted set of op-keys)  KEYS[3] submission index
//	ARGV[1] op-key  ARGV[2] index ttl ms  ARGV[3] submission score (started_at us)
//	ARGV[4] "1" to index the submission  ARGV[5] "1" to take over an id claimed by a vanished operation
//
// Returns {"conflict", other op-key} or {"ok"}.
var indexScript = redis.NewScript(`
local cur = redis.call('GET', KEYS[1])
if cur and cur ~= ARGV[1] and ARGV[5] ~= '1' then return {'conflict', cur} end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
redis.call('ZADD', KEYS[2], 'NX', 0, ARGV[1])
if ARGV[4] == '1' then
  redis.call('ZADD', KEYS[3], ARGV[3], ARGV[1])
  if redis.call('PTTL', KEYS[3]) < tonumber(ARGV[2]) then redis.call('PEXPIRE', KEYS[3], ARGV[2]) end
end
return {'ok'}
`)

// sweepScript removes a terminal operation whose last update is older than
// the cutoff.
//
//	KEYS[1] operation hash  KEYS[2] audit list
//	ARGV[1] cutoff (unix us)
//
// Returns 1 when removed, 0 otherwise.
var sweepScript = redis.NewScript(luaTerminal + `
local f = redis.call('HMGET', KEYS[1], 'phase', 'updus')
if not f[1] or not TERMINAL[f[1]] or tonumber(f[2]) >= tonumber(ARGV[1]) then return 0 end
redis.call('DEL', KEYS[1], KEYS[2])
return 1
`)

// exportScript reads an operation's chain and head in one atomic step.
//
//	KEYS[1] operation hash  KEYS[2] audit list
//
// Returns {id, acount, ahead, envelope...} or {} when absent.
var exportScript = redis.NewScript(`
local f = redis.call('HMGET', KEYS[1], 'id', 'acount', 'ahead')
if not f[1] then return {} end
local r = redis.call('LRANGE', KEYS[2], 0, -1)
table.insert(r, 1, f[3])
table.insert(r, 1, f[2])
table.insert(r, 1, f[1])
return r
`)
