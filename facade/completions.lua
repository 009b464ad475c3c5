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
local EVENT_PREFIX = "data: "
local UNKNOWN_FRAMING_BODY =
  '{"detail":"The REST facade cannot frame this reply (unknown framing); see its log."}'
-- The transcoder prints repeated fields even when empty; the error chunk has no choices.
local ERROR_EVENT_START = 'data: {"choices":[],"error":'
local ERROR_EVENT_START_CLEAN = 'data: {"error":'
-- What both of those events start with (a chunk of output starts with `data: {"id":`).
local SERVER_EVENT_START = 'data: {"choices":[]'

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

-- gRPC's own headers mean nothing to a REST client.
local function strip_grpc_headers(headers)
  headers:remove("grpc-accept-encoding")
  headers:remove("grpc-encoding")
end

local function reply_with_error(handle, headers, status)
  local body = headers:get("x-error-body") or '{"detail":"error"}'
  strip_grpc_headers(headers)
  headers:remove("x-http-status")
  headers:remove("x-error-body")
  headers:replace(":status", status)
  headers:replace("content-type", "application/json")
  handle:body(true):setBytes(body)
end

-- Streams the reply instead of buffering it, so a whole reply is bounded only by the
-- transcoder's reply limit. The transcoder prints compact JSON (a newline inside a string is
-- the escape `\n`), so the event's only raw newlines are its closing "\n\n".
local function reply_with_json(handle, headers)
  headers:remove("x-response-framing")
  strip_grpc_headers(headers)
  headers:replace("content-type", "application/json")
  local first = true
  for chunk in handle:bodyChunks() do
    local text = chunk:getBytes(0, chunk:length())
    local json = string.gsub(text, "\n", "")
    if first and string.sub(json, 1, #EVENT_PREFIX) == EVENT_PREFIX then
      json = string.sub(json, #EVENT_PREFIX + 1)
    end
    first = first and #json == 0
    if json ~= text then
      chunk:setBytes(json)
    end
  end
end

local function stream_events(handle, headers)
  headers:remove("x-response-framing")
  strip_grpc_headers(headers)
  headers:replace("cache-control", "no-cache")
  for chunk in handle:bodyChunks() do
    local text = chunk:getBytes(0, chunk:length())
    -- One search per chunk; only the stream's last events (the end sentinel, an error) match.
    if string.find(text, SERVER_EVENT_START, 1, true) ~= nil then
      chunk:setBytes(replace_plain(replace_plain(text, END_EVENT, DONE_EVENT),
                                   ERROR_EVENT_START, ERROR_EVENT_START_CLEAN))
    end
  end
end

-- The transcoder drops content-length; envoy.yaml's local_reply_config reads the body size
-- from this copy to decide whether a parse error may quote the offending value.
function envoy_on_request(handle)
  local headers = handle:headers()
  local length = headers:get("content-length")
  if length ~= nil then
    headers:replace("x-request-body-bytes", length)
  else
    headers:remove("x-request-body-bytes")
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
  elseif framing ~= nil then
    -- A server newer or older than this filter: refuse loudly rather than pass on a reply
    -- framed wrongly.
    handle:logErr("completions.lua: unknown x-response-framing '" .. framing .. "'")
    headers:remove("x-response-framing")
    headers:replace(":status", "500")
    headers:replace("content-type", "application/json")
    handle:body(true):setBytes(UNKNOWN_FRAMING_BODY)
  end
end
