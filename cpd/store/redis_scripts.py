"""The Lua scripts of the Redis store, each an atomic step of the visibility protocol or of the
LRU bookkeeping (:mod:`cpd.store.visibility`, :mod:`cpd.store.redis_store`), and
:class:`RedisScripts`, the set registered with one client (standalone or cluster)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# KEYS[1]=staging key; ARGV: offset, ttl_ms, bytes. A continuation of a reclaimed (expired)
# staging key fails instead of recreating a zero-padded value.
_STAGE_LUA = """
if tonumber(ARGV[1]) > 0 and redis.call('STRLEN', KEYS[1]) ~= tonumber(ARGV[1]) then return -1 end
redis.call('SETRANGE', KEYS[1], ARGV[1], ARGV[3])
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
"""

# KEYS: staging, final; ARGV: expected length. Seal = atomic rename-if-absent of a complete value.
_SEAL_LUA = """
if redis.call('STRLEN', KEYS[1]) ~= tonumber(ARGV[1]) then redis.call('DEL', KEYS[1]) return -1 end
if redis.call('EXISTS', KEYS[2]) == 1 then redis.call('DEL', KEYS[1]) return 0 end
redis.call('RENAME', KEYS[1], KEYS[2])
if tonumber(ARGV[2] or '0') > 0 then redis.call('PEXPIRE', KEYS[2], ARGV[2]) else redis.call('PERSIST', KEYS[2]) end
return 1
"""

# KEYS: lru, info, used; ARGV: now, then (chunk key, info) pairs of values this client made
# visible. Records size+hashes once per key, bumps recency. Returns bytes used.
_ACCOUNT_LUA = """
for i = 2, #ARGV, 2 do
  if redis.call('HSETNX', KEYS[2], ARGV[i], ARGV[i+1]) == 1 then
    redis.call('INCRBY', KEYS[3], tonumber(string.match(ARGV[i+1], '^%d+')))
  end
  redis.call('ZADD', KEYS[1], ARGV[1], ARGV[i])
end
return tonumber(redis.call('GET', KEYS[3]) or '0')
"""

# KEYS: lru, info, used; ARGV: chunk keys that are gone. Forgets them (idempotent: the size is
# subtracted only by the call that removes the info field). Returns each key's info or nil.
_FORGET_LUA = """
local out = {}
for i = 1, #ARGV do
  local v = redis.call('HGET', KEYS[2], ARGV[i])
  if v then
    redis.call('HDEL', KEYS[2], ARGV[i])
    redis.call('DECRBY', KEYS[3], tonumber(string.match(v, '^%d+')))
  end
  redis.call('ZREM', KEYS[1], ARGV[i])
  out[i] = v or false
end
return out
"""

# KEYS: lru, info, used; ARGV: target bytes, max names. The oldest chunk keys whose sizes cover
# the excess over the target (empty when at or below it).
_PICK_LUA = """
local need = tonumber(redis.call('GET', KEYS[3]) or '0') - tonumber(ARGV[1])
local out = {}
if need <= 0 then return out end
local names = redis.call('ZRANGE', KEYS[1], 0, tonumber(ARGV[2]) - 1)
for i = 1, #names do
  out[#out + 1] = names[i]
  local v = redis.call('HGET', KEYS[2], names[i])
  if v then need = need - tonumber(string.match(v, '^%d+')) end
  if need <= 0 then break end
end
return out
"""

_INVALIDATE_LUA = """
local t = redis.call('GETRANGE', KEYS[1], -8, -1)
if t == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


@dataclass(frozen=True)
class RedisScripts:
    """The scripts registered with one redis-py client (``Script`` objects, called as
    ``script(keys=[...], args=[...])``)."""

    stage: Any  # WRITING: append staged bytes (fails on a reclaimed staging key)
    seal: Any  # SEALED+VISIBLE: rename-if-absent of a complete value
    invalidate: Any  # EVICTED: delete a corrupt value if unchanged
    account: Any  # bookkeeping: record visible chunks, bump recency
    forget: Any  # bookkeeping: drop gone chunks
    pick: Any  # bookkeeping: choose LRU victims

    @classmethod
    def register(cls, client: Any) -> "RedisScripts":
        return cls(stage=client.register_script(_STAGE_LUA), seal=client.register_script(_SEAL_LUA),
                   invalidate=client.register_script(_INVALIDATE_LUA), account=client.register_script(_ACCOUNT_LUA),
                   forget=client.register_script(_FORGET_LUA), pick=client.register_script(_PICK_LUA))
