-- Single events: every request is one event, alternately a `start` of a new step and the
-- `complete` of the step this thread started LAG starts earlier (by then its start has been
-- answered, so each record goes running -> completed). Steps are new random slugs on
-- random instances; every event carries `attempt` and its timestamps.
-- Arguments (after `--`): key prefix, number of instances, LAG.
require "common"

local headers = with_token({ ["Content-Type"] = "application/json" })
local prefix, instances, lag = "e", 5000, 16
local started = {} -- ring of the last LAG started steps: { path, time }
local seq, completing = 0, false

function init(args)
   prefix = args[1] or prefix
   instances = tonumber(args[2]) or instances
   lag = tonumber(args[3]) or lag
   math.randomseed(os.time() * 1000 + tid)
end

function request()
   local now = os.time()
   completing = not completing
   if not completing then
      seq = seq + 1
      local path = string.format("/v1/instances/%s%d/steps/s%d-%d-%x", prefix,
         math.random(instances), tid, seq, math.random(0, 0xffffff))
      started[seq % lag] = { path, now }
      local body = string.format('{"attempt":1,"started_at":"%s"}', stamp(now))
      return wrk.format("POST", path .. "/start", headers, body)
   end
   -- The first LAG completes name steps that were never started: they create the record.
   local step = started[(seq + 1) % lag] or {
      string.format("/v1/instances/%s%d/steps/s%d-0-%d", prefix, math.random(instances), tid, seq),
      now,
   }
   local body = string.format('{"attempt":1,"started_at":"%s","completed_at":"%s","output":%s}',
      stamp(step[2]), stamp(now), OUTPUT)
   return wrk.format("POST", step[1] .. "/complete", headers, body)
end
