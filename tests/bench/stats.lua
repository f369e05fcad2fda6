-- Step statistics across instances: `GET /v1/stats/steps?since=…&until=…`, the read table's
-- attempts that started in one window (by default its first minute: about 60 attempts of
-- each instance), grouped by step name; on Citus every shard's attempts in the window go to
-- the coordinator, which computes the percentiles.
-- Arguments (after `--`): since, until (RFC 3339).
require "common"

local path = ""

function init(args)
   local since = args[1] or "2026-01-01T00:00:00Z"
   local till = args[2] or "2026-01-01T00:01:00Z"
   path = string.format("/v1/stats/steps?since=%s&until=%s", since, till)
end

function request()
   return wrk.format("GET", path, with_token({}))
end
