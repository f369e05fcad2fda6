-- Reads across instances: `GET /v1/steps?status=STATUS&limit=LIMIT`, the first page of the
-- records of one status (a random one of four) over every instance, newest first: on Citus
-- a statement over every shard, merged on the coordinator.
-- Arguments (after `--`): limit.
require "common"

local statuses = { "pending", "running", "completed", "failed" }
local limit = "100"

function init(args)
   limit = args[1] or limit
   math.randomseed(os.time() * 1000 + tid)
end

function request()
   local status = statuses[math.random(#statuses)]
   local path = string.format("/v1/steps?status=%s&limit=%s", status, limit)
   return wrk.format("GET", path, with_token({}))
end
