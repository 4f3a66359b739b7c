"""Reading the namespace's queue in effective-priority order, across its priority classes.

Each priority class has its own request stream. A request's *urgency* is its class minus
its age in aging periods counted from a fixed origin (`class - arrival_ms / aging_ms`): at
any moment, ordering by effective priority (class + time waited / aging period) is ordering
by urgency, so the order needs no clock and never changes while requests wait. The intake
script delivers, in one atomic step, the most urgent undelivered entries over every class
(the oldest first within a class), and lists the newest, least urgent entries past the
namespace's bound so the batcher can end them `queue_full`. Tenants other than `default`
have class streams of their own (`{ns}:queues` lists those in use): within a class the
script delivers in the tenants' fair order, and with the pool full it still delivers the
entries of a tenant under its fair share, so the planner can give it a slot.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast

import redis

from batcher.durability import Delivery
from batcher.fairness import TenantShare, share_of
from schemas.keys import GROUP, PRIORITY_CLASSES, Keys, priority_class

INTAKE_SCRIPT = """
local group, consumer = ARGV[1], ARGV[2]
local wanted, aging = tonumber(ARGV[3]), tonumber(ARGV[4])
local threshold, extra = tonumber(ARGV[5]), tonumber(ARGV[6])
local bound, capacity = tonumber(ARGV[7]), tonumber(ARGV[8])
local fair_extra = ARGV[9] == '1'
local weight, held, cap = {}, {}, {}
local a = 11
for _ = 1, tonumber(ARGV[10]) do
  local name = ARGV[a]
  weight[name], held[name], cap[name] = tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2]),
                                        tonumber(ARGV[a + 3])
  a = a + 4
end
local streams, classes, owner = {}, {}, {}
local n = #KEYS - 1
for i = 1, n do
  streams[i], classes[i], owner[i] = KEYS[i], tonumber(ARGV[a + i - 1]), 'default'
end
local queues = redis.call('HGETALL', KEYS[n + 1])
for i = 1, #queues, 2 do
  table.insert(streams, queues[i])
  table.insert(classes, tonumber(string.match(queues[i], ':p(%-?%d+)$')) or 0)
  table.insert(owner, queues[i + 1])
end
n = #streams
local last, heads = {}, {}
local depth = 0

local function id_ms(id) return tonumber(string.match(id, '^(%d+)')) end
local function w(t) return weight[t] or 1 end
local function h(t) return held[t] or 0 end
local function capped(t) return (cap[t] or 0) > 0 and h(t) >= cap[t] end

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
  local nxt = redis.call('XRANGE', streams[i], '(' .. last[i], '+', 'COUNT', 1)
  if #nxt == 0 then heads[i] = nil; return end
  heads[i] = {nxt[1][1], classes[i] - id_ms(nxt[1][1]) / aging}
end

local function older(x, y)
  local xm, xs = string.match(x, '^(%d+)-(%d+)')
  local ym, ys = string.match(y, '^(%d+)-(%d+)')
  if tonumber(xm) ~= tonumber(ym) then return tonumber(xm) < tonumber(ym) end
  return tonumber(xs) < tonumber(ys)
end

-- true when stream i's head comes before stream j's in urgency order
local function before(i, j)
  local x, y = heads[i], heads[j]
  return x[2] > y[2] or (x[2] == y[2] and older(x[1], y[1]))
end

for i = 1, n do
  local size = redis.call('XLEN', streams[i])
  depth = depth + size
  if size > 0 then
    last[i] = last_delivered(streams[i])
    peek(i)
  end
end

-- the tenants' fair shares of the pool's capacity, over those holding or queueing work
local active, total = {}, 0
for t, count in pairs(held) do
  if count > 0 and not active[t] then active[t] = true; total = total + w(t) end
end
for i = 1, n do
  if heads[i] and not active[owner[i]] then active[owner[i]] = true; total = total + w(owner[i]) end
end
local function deficit(t) return capacity * w(t) / total - h(t) end
local function below_share(t) return not capped(t) and deficit(t) >= 1 - 1e-9 end

local out, fair_left = {}, fair_extra and capacity or 0
while true do
  local best = nil
  for i = 1, n do
    if heads[i] and not capped(owner[i]) and (best == nil or before(i, best)) then best = i end
  end
  if best == nil then break end
  local pick = best
  for i = 1, n do
    if heads[i] and i ~= pick and classes[i] == classes[best] and not capped(owner[i]) then
      local di, dp = deficit(owner[i]), deficit(owner[pick])
      if di > dp or (di == dp and before(i, pick)) then pick = i end
    end
  end
  if #out >= wanted then
    if extra > 0 and heads[best][2] > threshold then
      pick = best
      extra = extra - 1
    else
      pick = nil
      if fair_left > 0 then
        for i = 1, n do
          if heads[i] and below_share(owner[i]) and (pick == nil or before(i, pick)) then
            pick = i
          end
        end
      end
      if pick == nil then break end
      fair_left = fair_left - 1
    end
  end
  local got = redis.call('XREADGROUP', 'GROUP', group, consumer, 'COUNT', 1,
                         'STREAMS', streams[pick], '>')
  local entry = got[1][2][1]
  table.insert(out, {streams[pick], entry[1], entry[2]})
  held[owner[pick]] = h(owner[pick]) + 1
  last[pick] = entry[1]
  peek(pick)
end

-- past the bound: the newest entries of the lowest classes, not yet delivered
local lowest = {}
for i = 1, n do lowest[i] = i end
table.sort(lowest, function(x, y)
  if classes[x] ~= classes[y] then return classes[x] < classes[y] end
  return x > y
end)
local excess = {}
local over = depth - bound
for _, i in ipairs(lowest) do
  if over <= 0 then break end
  if last[i] then
    local newest = redis.call('XREVRANGE', streams[i], '+', '(' .. last[i], 'COUNT', over)
    for _, entry in ipairs(newest) do
      table.insert(excess, {streams[i], entry[1], entry[2]})
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


@dataclass(frozen=True, slots=True)
class Holding:
    """What the pool holds of the tenants' work, for the intake's fair order
    (batcher/fairness.py): each tenant's requests held (running or waiting), its weight and
    cap, and the pool's capacity."""

    capacity: int = 0
    held: dict[str, int] = field(default_factory=dict)
    tenants: dict[str, TenantShare] = field(default_factory=dict)
    under_share: bool = False  # deliver a tenant under its share even with no room (it preempts)

    def args(self) -> list[Any]:
        """The script's ARGV for it, from the capacity on."""
        names = sorted(self.held.keys() | self.tenants.keys())
        args: list[Any] = [self.capacity, int(self.under_share), len(names)]
        for name in names:
            share = share_of(self.tenants, name)
            args += [name, repr(share.weight), self.held.get(name, 0), share.max_running or 0]
        return args


class QueueReader:
    """Runs the intake script for one pool (consumer) of a namespace."""

    def __init__(self, client: redis.Redis, keys: Keys, pool: str, aging_s: float) -> None:
        self.keys = keys
        self.pool = pool
        self.aging_ms = aging_s * 1000
        self.streams = [*keys.request_streams, keys.queues]
        self._intake = client.register_script(INTAKE_SCRIPT)

    def read(
        self,
        wanted: int,
        bound: int,
        threshold: float = float("inf"),
        extra: int = 0,
        holding: Holding | None = None,
    ) -> IntakeReply:
        """Deliver up to `wanted` entries in fair urgency order (batcher/fairness.py), plus
        up to `extra` more whose urgency is over `threshold` and any of a tenant still
        under its fair share of `holding`'s capacity; list the entries past `bound` (not
        delivered)."""
        args: list[Any] = [GROUP, self.pool, wanted, self.aging_ms, _lua_number(threshold)]
        args += [extra, bound, *(holding or Holding()).args(), *PRIORITY_CLASSES]
        depth, delivered, excess = cast(list[Any], self._intake(keys=self.streams, args=args))
        return IntakeReply(int(depth), _deliveries(delivered), _deliveries(excess))


def _deliveries(rows: list[Any]) -> list[Delivery]:
    found = []
    for stream, entry_id, flat in rows:
        fields = {flat[i]: flat[i + 1] for i in range(0, len(flat), 2)}
        found.append(Delivery(entry_id, fields, 1, bytes(stream).decode()))
    return found


def _lua_number(value: float) -> str:
    """A float as Lua's tonumber reads it (inf included)."""
    if value == float("inf"):
        return "1e308"
    return repr(value)
