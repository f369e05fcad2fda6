-- Replayed events: every request is `POST .../start` with attempt 1 of an existing record of
-- the table tests/bench/citus.py loads (the read benchmark's, instances PREFIX1 .. PREFIXn,
-- steps step-0 .. step-(STEPS-1), none pending): the judge finds the record, locks it, judges
-- the event a replay (or a late start of attempt 1) and answers it as it stands, writing
-- nothing. Every answer must be a 200.
-- Arguments (after `--`): key prefix, number of instances, STEPS.
require "common"

local headers = with_token({ ["Content-Type"] = "application/json" })
local prefix, instances, steps = "r", 20, 95
local body = '{"attempt":1,"started_at":"2026-01-01T00:00:00Z"}'

function init(args)
   prefix = args[1] or prefix
   instances = tonumber(args[2]) or instances
   steps = tonumber(args[3]) or steps
   math.randomseed(os.time() * 1000 + tid)
end

function request()
   local path = string.format("/v1/instances/%s%d/steps/step-%d/start", prefix,
      math.random(instances), math.random(0, steps - 1))
   return wrk.format("POST", path, headers, body)
end
