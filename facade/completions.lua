-- Frames transcoded /v2/completions replies as the REST API promises.
--
-- The gRPC server decides (it parses `stream` exactly as the transcoder does) and says so in
-- response metadata; this filter only applies that decision:
--   x-http-status/x-error-body  an error before any output: that status and JSON body.
--   x-response-framing: json     a non-streamed reply: the one SSE event becomes a JSON body.
--   x-response-framing: sse      a streamed reply: events pass through as they come; the
--                                server's empty end message becomes `data: [DONE]`, and an
--                                in-band error event is printed in the reference's shape.

local END_EVENT = 'data: {"choices":[]}\n\n'
local DONE_EVENT = "data: [DONE]\n\n"
-- The transcoder prints repeated fields even when empty; the error chunk has no choices.
local ERROR_EVENT_START = 'data: {"choices":[],"error":'
local ERROR_EVENT_START_CLEAN = 'data: {"error":'

local function replace_plain(text, old, new)
  local result, position = {}, 1
  while true do
    local first, last = string.find(text, old, position, true)
    if first == nil then break end
    table.insert(result, string.sub(text, position, first - 1))
    table.insert(result, new)
    position = last + 1
  end
  table.insert(result, string.sub(text, position))
  return table.concat(result)
end

local function reply_with_error(handle, headers, status)
  local body = headers:get("x-error-body") or '{"detail":"error"}'
  headers:remove("x-http-status")
  headers:remove("x-error-body")
  headers:replace(":status", status)
  headers:replace("content-type", "application/json")
  handle:body(true):setBytes(body)
end

local function reply_with_json(handle, headers)
  headers:remove("x-response-framing")
  headers:replace("content-type", "application/json")
  local body = handle:body(true)
  local event = body:getBytes(0, body:length())
  local json = string.match(event, "^data: (.*)\n\n$") or event
  body:setBytes(json)
end

local function stream_events(handle, headers)
  headers:remove("x-response-framing")
  headers:replace("cache-control", "no-cache")
  for chunk in handle:bodyChunks() do
    local text = chunk:getBytes(0, chunk:length())
    local framed = replace_plain(replace_plain(text, END_EVENT, DONE_EVENT),
                                 ERROR_EVENT_START, ERROR_EVENT_START_CLEAN)
    if framed ~= text then
      chunk:setBytes(framed)
    end
  end
end

function envoy_on_response(handle)
  local headers = handle:headers()
  local status = headers:get("x-http-status")
  if status ~= nil then
    reply_with_error(handle, headers, status)
    return
  end
  local framing = headers:get("x-response-framing")
  if framing == "json" then
    reply_with_json(handle, headers)
  elseif framing == "sse" then
    stream_events(handle, headers)
  end
end
