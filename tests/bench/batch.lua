-- Batches: every request is `POST /v1/events` with SIZE events, half `start` of new steps,
-- half `complete` of the steps this thread started LAG requests earlier (answered by then,
-- so each record goes running -> completed). Random instances, explicit attempts and
-- timestamps, as in events.lua. Every result must be a 200/201.
-- Arguments (after `--`): key prefix, number of instances, LAG, SIZE.
require "common"

local headers = with_token({ ["Content-Type"] = "application/json" })
local prefix, instances, lag, half = "b", 5000, 16, 50
local sent = {} -- ring of the last LAG batches' starts: { {instance, slug}..., time = t }
local seq = 0

function init(args)
   prefix = args[1] or prefix
   instances = tonumber(args[2]) or instances
   lag = tonumber(args[3]) or lag
   half = math.floor((tonumber(args[4]) or 100) / 2)
   expected_events = 2 * half
   math.randomseed(os.time() * 1000 + tid)
end

local function event(instance, slug, kind, fields)
   return string.format('{"instance_key":"%s%d","step_slug":"%s","kind":"%s","attempt":1,%s}',
      prefix, instance, slug, kind, fields)
end

function request()
   seq = seq + 1
   local now = os.time()
   local events, steps = {}, { time = now }
   local start = string.format('"started_at":"%s"', stamp(now))
   for g = 1, half do
      local step = { math.random(instances), string.format("s%d-%d-%d", tid, seq, g) }
      steps[g] = step
      events[g] = event(step[1], step[2], "start", start)
   end
   -- The first LAG batches complete steps that were never started: they create the record.
   local old = sent[seq % lag]
   sent[seq % lag] = steps
   for g = 1, half do
      local step = old and old[g] or { math.random(instances), string.format("s%d-0-%d-%d", tid, seq, g) }
      local fields = string.format('"started_at":"%s","completed_at":"%s","output":%s',
         stamp(old and old.time or now), stamp(now), OUTPUT)
      events[half + g] = event(step[1], step[2], "complete", fields)
   end
   return wrk.format("POST", "/v1/events", headers, '{"events":[' .. table.concat(events, ",") .. "]}")
end
