-- Sets the headers Envoy's routes match and hash on (facade/balancing.py).
--
-- Runs after the transcoder, so REST and gRPC calls look alike here: the gRPC field
-- extraction filter before this one has read the request's `model` and, for a completion, its
-- prompt into dynamic metadata. facade/launch.py sets PREFIX_CHARS and PREFIX_TOKENS (0: no
-- key) ahead of this code.
--
-- x-model: the pool's routes match it (several pools). A call without a model (ListModels),
--   or with a name longer than any served one, loses any x-model a client sent and takes the
--   route to any pool, whose replica answers it (a 404 for a name nobody serves).
-- x-prefix-key: a digest of a completion's model and the leading part of its first prompt
--   (its first PREFIX_CHARS bytes of text, or first PREFIX_TOKENS token ids): Envoy hashes it
--   to pick the replica. Any x-prefix-key a client sent is dropped.
-- x-replica: only the replica picker (facade/picker) sets it, after this filter; one a client
--   sent is dropped, so that no caller can pin a replica.
--
-- Both headers reach the replica as gRPC metadata too, so both stay short: a request's own
-- values (a 100,000-character model name) must not push it past the replica's metadata limit.

local EXTRACTION = "envoy.filters.http.grpc_field_extraction"
local MAX_MODEL_BYTES = 256

-- FNV-1a, 32 bits, in LuaJIT's bit operations (16777619 = 2^24 + 403, multiplied in two
-- parts so that no product leaves the exact range of a double).
local function digest(text)
  local hash = bit.tobit(2166136261)
  for i = 1, #text do
    hash = bit.bxor(hash, string.byte(text, i))
    hash = bit.tobit(bit.lshift(hash, 24) + hash * 403)
  end
  return bit.tohex(hash)
end

local function first(list)
  return list and list[1]
end

local function leading_part(fields)
  local text = first(fields["prompt.string_value"])
    or first(fields["prompt.list_value.values.string_value"])
  if text ~= nil then
    return "text:" .. string.sub(text, 1, PREFIX_CHARS)
  end
  local tokens = fields["prompt.list_value.values.number_value"]
  if tokens == nil or tokens[1] == nil then
    tokens = fields["prompt.list_value.values.list_value.values.number_value"]
  end
  if tokens == nil or tokens[1] == nil then
    return nil
  end
  local ids = {}
  for i = 1, math.min(#tokens, PREFIX_TOKENS) do
    ids[i] = tokens[i]
  end
  return "ids:" .. table.concat(ids, ",")
end

function envoy_on_request(handle)
  local headers = handle:headers()
  local fields = handle:streamInfo():dynamicMetadata():get(EXTRACTION) or {}
  local model = first(fields["model"])
  if model ~= nil and #model > MAX_MODEL_BYTES then
    model = nil
  end
  if model ~= nil then
    headers:replace("x-model", model)
  else
    headers:remove("x-model")
  end
  local prefix = nil
  if model ~= nil and PREFIX_CHARS > 0 then
    prefix = leading_part(fields)
  end
  if prefix ~= nil then
    headers:replace("x-prefix-key", digest(model .. "\n" .. prefix))
  else
    headers:remove("x-prefix-key")
  end
  headers:remove("x-replica")
  handle:clearRouteCache()
end
