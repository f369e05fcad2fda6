-- Reads: `GET /v1/instances/{key}/steps?order=ORDER&limit=LIMIT` for a random instance of
-- the table run.py loaded (keys PREFIX1 .. PREFIXn).
-- Arguments (after `--`): key prefix, number of instances, order, limit.
require "common"

local prefix, instances, query = "r", 20, "order=ordinal&limit=100"

function init(args)
   prefix = args[1] or prefix
   instances = tonumber(args[2]) or instances
   query = string.format("order=%s&limit=%s", args[3] or "ordinal", args[4] or "100")
   math.randomseed(os.time() * 1000 + tid)
end

function request()
   local path = string.format("/v1/instances/%s%d/steps?%s", prefix, math.random(instances), query)
   return wrk.format("GET", path, with_token({}))
end
