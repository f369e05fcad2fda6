-- Shared by the wrk scripts (loaded with `require "common"`; run.py sets LUA_PATH):
-- numbers the threads, counts every response that is not a success and prints one
-- machine-readable line, `BENCH {...}`, that run.py parses.

local threads = {}

-- With --token, run.py passes a write token: every request carries it.
local token = os.getenv("STEPRECORD_BENCH_TOKEN")

function with_token(headers)
   if token then
      headers["Authorization"] = "Bearer " .. token
   end
   return headers
end

function setup(thread)
   table.insert(threads, thread)
   thread:set("tid", #threads)
end

bad_http = 0 -- responses whose HTTP status is not 2xx
bad_events = 0 -- batch results that are not a 200/201 (missing ones included)
sample = "" -- the first bad response, for the report
expected_events = 0 -- results a batch response must hold (0: not a batch)

local function remember(status, body)
   if sample == "" then
      sample = string.format("HTTP %d: %s", status, string.sub(body or "", 1, 400))
   end
end

function response(status, headers, body)
   if status < 200 or status > 299 then
      bad_http = bad_http + 1
      remember(status, body)
   elseif expected_events > 0 then
      -- Each result carries a numeric "status"; the records' own "status" is a string.
      local _, ok = string.gsub(body, '"status":20[01]', "")
      if ok ~= expected_events then
         bad_events = bad_events + (expected_events - ok)
         remember(status, body)
      end
   end
end

function done(summary, latency, requests)
   local http, events, first = 0, 0, ""
   for _, thread in ipairs(threads) do
      http = http + thread:get("bad_http")
      events = events + thread:get("bad_events")
      if first == "" then
         first = thread:get("sample")
      end
   end
   local e = summary.errors
   io.write(string.format(
      'BENCH {"requests": %d, "duration_us": %d, "socket_errors": %d, "bad_http": %d, '
         .. '"bad_events": %d, "p50_us": %.0f, "p99_us": %.0f}\n',
      summary.requests, summary.duration, e.connect + e.read + e.write + e.timeout,
      http, events, latency:percentile(50), latency:percentile(99)))
   if first ~= "" then
      io.write("SAMPLE " .. string.gsub(first, "\n", " ") .. "\n")
   end
end

-- An RFC 3339 UTC timestamp with a Z.
function stamp(t)
   return os.date("!%Y-%m-%dT%H:%M:%SZ", t)
end

OUTPUT = '{"a":1,"b":"x","n":123}'
