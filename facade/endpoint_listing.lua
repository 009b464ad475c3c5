-- The endpoint's listing for the calls no pool owns (ListModels, and a `model` no pool serves),
-- asked of every pool when the call is made (facade/render.py installs this filter with
-- several pools, marks the route of those calls with LIVE_LISTING in its metadata, and sets
-- LISTING_POOLS, LISTING_HEADER, LIST_MODELS, LIVE_LISTING, MAX_LISTING_HEADER_BYTES and
-- LISTING_TIMEOUT_MS ahead of this code).
--
-- The replica that answers such a call lists the whole endpoint (or names it in its 404) from
-- the listing Envoy passes with the call (LISTING_HEADER, a serialized
-- ListModelsResponse). The route passes the listing learned at launch; this filter asks one
-- replica of each pool instead, with the caller's own credentials, so adapters a pool gains or
-- retires while it serves are listed as they come and go. A pool that does not answer is
-- listed as it was at launch.
-- Serialized protobuf messages of one type, concatenated, are one message whose repeated
-- fields are appended: the pools' replies together are the endpoint's listing.
--
-- One a client sent is dropped on every call, so that no caller can dictate a listing.

-- A ListModelsRequest (no fields) in one uncompressed gRPC frame.
local EMPTY_REQUEST = "\0\0\0\0\0"

-- The message of a unary gRPC reply: one uncompressed frame (an error comes as trailers only).
local function reply_message(headers, body)
  if headers == nil or headers[":status"] ~= "200" or (headers["grpc-status"] or "0") ~= "0" then
    return nil
  end
  if body == nil or #body < 5 or string.byte(body, 1) ~= 0 then
    return nil
  end
  local b2, b3, b4, b5 = string.byte(body, 2, 5)
  if ((b2 * 256 + b3) * 256 + b4) * 256 + b5 ~= #body - 5 then
    return nil
  end
  return string.sub(body, 6)
end

local function pool_listing(handle, pool, authorization)
  local request = {
    [":method"] = "POST",
    [":path"] = LIST_MODELS,
    [":authority"] = pool.cluster,
    ["content-type"] = "application/grpc",
    ["te"] = "trailers",
  }
  if authorization ~= nil then
    request["authorization"] = authorization
  end
  local headers, body = handle:httpCall(
    pool.cluster, request, EMPTY_REQUEST, { timeout_ms = LISTING_TIMEOUT_MS, send_xff = false }
  )
  local listing = reply_message(headers, body)
  if listing == nil then
    local reason = headers and (headers["grpc-message"] or headers[":status"]) or "no reply"
    handle:logWarn("pool " .. pool.cluster .. " did not list its models (" .. reason .. "): "
      .. "it is listed as at launch")
    return pool.at_launch
  end
  return listing
end

function envoy_on_request(handle)
  local headers = handle:headers()
  headers:remove(LISTING_HEADER)
  if not handle:metadata():get(LIVE_LISTING) then
    return
  end
  local authorization = headers:get("authorization")
  local listings = {}
  for i, pool in ipairs(LISTING_POOLS) do
    listings[i] = pool_listing(handle, pool, authorization)
  end
  local value = handle:base64Escape(table.concat(listings))
  if #value > MAX_LISTING_HEADER_BYTES then
    -- Too many to pass along: the route passes the listing learned at launch.
    handle:logWarn("the endpoint's models no longer fit in one header: listed as at launch")
    return
  end
  -- The headers' handle does not outlive the calls above (they yield): take it again.
  handle:headers():replace(LISTING_HEADER, value)
end
