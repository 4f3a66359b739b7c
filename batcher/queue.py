"""Reading the namespace's queue in effective-priority order, across its priority classes.

Each priority class has its own request stream. A request's *urgency* is its class minus
its age in aging periods counted from a fixed origin (`class - arrival_ms / aging_ms`): at
any moment, ordering by effective priority (class + time waited / aging period) is ordering
by urgency, so the order needs no clock and never changes while requests wait. The intake
script delivers, in one atomic step, the most urgent undelivered entries over every class
(the oldest first within a class), and lists the newest, least urgent entries past the
namespace's bound so the batcher can end them `queue_full`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import redis

from batcher.durability import Delivery
from schemas.keys import GROUP, PRIORITY_CLASSES, Keys, priority_class

INTAKE_SCRIPT = """
local group, consumer = ARGV[1], ARGV[2]
local wanted, aging = tonumber(ARGV[3]), tonumber(ARGV[4])
local threshold, extra = tonumber(ARGV[5]), tonumber(ARGV[6])
local bound = tonumber(ARGV[7])
local n = #KEYS
local classes, last, heads = {}, {}, {}
local depth = 0

local function id_ms(id) return tonumber(string.match(id, '^(%d+)')) end

local function last_delivered(key)
  local ok, groups = pcall(redis.call, 'XINFO', 'GROUPS', key)
  if ok then
    for _, g in ipairs(groups) do
      local name, id
      for i = 1, #g, 2 do
        if g[i] == 'name' then name = g[i + 1] end
        if g[i] == 'last-delivered-id' then id = g[i + 1] end
      end
      if name == group then return id end
    end
  end
  redis.call('XGROUP', 'CREATE', key, group, '0', 'MKSTREAM')
  return '0-0'
end

local function peek(i)
  local nxt = redis.call('XRANGE', KEYS[i], '(' .. last[i], '+', 'COUNT', 1)
  if #nxt == 0 then heads[i] = nil; return end
  heads[i] = {nxt[1][1], classes[i] - id_ms(nxt[1][1]) / aging}
end

local function older(a, b)
  local am, as = string.match(a, '^(%d+)-(%d+)')
  local bm, bs = string.match(b, '^(%d+)-(%d+)')
  if tonumber(am) ~= tonumber(bm) then return tonumber(am) < tonumber(bm) end
  return tonumber(as) < tonumber(bs)
end

for i = 1, n do
  classes[i] = tonumber(ARGV[7 + i])
  local size = redis.call('XLEN', KEYS[i])
  depth = depth + size
  if size > 0 then
    last[i] = last_delivered(KEYS[i])
    peek(i)
  end
end

local out = {}
while true do
  local best = nil
  for i = 1, n do
    local h = heads[i]
    if h and (best == nil or h[2] > heads[best][2]
              or (h[2] == heads[best][2] and older(h[1], heads[best][1]))) then
      best = i
    end
  end
  if best == nil then break end
  if #out >= wanted then
    if extra <= 0 or heads[best][2] <= threshold then break end
    extra = extra - 1
  end
  local got = redis.call('XREADGROUP', 'GROUP', group, consumer, 'COUNT', 1,
                         'STREAMS', KEYS[best], '>')
  local entry = got[1][2][1]
  table.insert(out, {best, entry[1], entry[2]})
  last[best] = entry[1]
  peek(best)
end

local excess = {}
local over = depth - bound
for i = n, 1, -1 do
  if over <= 0 then break end
  if last[i] then
    local newest = redis.call('XREVRANGE', KEYS[i], '+', '(' .. last[i], 'COUNT', over)
    for _, entry in ipairs(newest) do
      table.insert(excess, {i, entry[1], entry[2]})
    end
    over = over - #newest
  end
end
return {depth, out, excess}
"""


def urgency(priority: int, arrival_ms: int, aging_ms: float) -> float:
    """A request's place in the effective-priority order: higher comes first."""
    return priority_class(priority) - arrival_ms / aging_ms


def arrival_ms(entry_id: bytes) -> int:
    """When an entry was added, from its stream id."""
    return int(entry_id.split(b"-", 1)[0])


@dataclass(slots=True)
class IntakeReply:
    """What one intake step read: entries now held by this pool, and entries past the bound."""

    depth: int
    deliveries: list[Delivery]
    excess: list[Delivery]


class QueueReader:
    """Runs the intake script for one pool (consumer) of a namespace."""

    def __init__(self, client: redis.Redis, keys: Keys, pool: str, aging_s: float) -> None:
        self.keys = keys
        self.pool = pool
        self.aging_ms = aging_s * 1000
        self.streams = keys.request_streams
        self._intake = client.register_script(INTAKE_SCRIPT)

    def read(
        self, wanted: int, bound: int, threshold: float = float("inf"), extra: int = 0
    ) -> IntakeReply:
        """Deliver up to `wanted` entries in urgency order, plus up to `extra` more whose
        urgency is over `threshold`; list the entries past `bound` (not delivered)."""
        args: list[Any] = [GROUP, self.pool, wanted, self.aging_ms, _lua_number(threshold)]
        args += [extra, bound, *PRIORITY_CLASSES]
        depth, delivered, excess = cast(list[Any], self._intake(keys=self.streams, args=args))
        return IntakeReply(int(depth), self._deliveries(delivered), self._deliveries(excess))

    def _deliveries(self, rows: list[Any]) -> list[Delivery]:
        found = []
        for index, entry_id, flat in rows:
            fields = {flat[i]: flat[i + 1] for i in range(0, len(flat), 2)}
            found.append(Delivery(entry_id, fields, 1, self.streams[int(index) - 1]))
        return found


def _lua_number(value: float) -> str:
    """A float as Lua's tonumber reads it (inf included)."""
    if value == float("inf"):
        return "1e308"
    return repr(value)
