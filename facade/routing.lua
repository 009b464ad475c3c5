-- Sets the headers Envoy's routes match and hash on (facade/balancing.py).
--
-- Runs after the transcoder, so REST and gRPC calls look alike here: the gRPC field
-- extraction filter before this one has read the request's `model` and, for a completion, its
-- prompt into dynamic metadata. facade/balancing.py sets PREFIX_CHARS and PREFIX_TOKENS (0: no
-- key) and PREFIX_PATH ahead of this code.
--
-- x-model: the pool's routes match it (several pools). A call without a model (ListModels),
--   or with a name longer than any served one, loses any x-model a client sent and takes the
--   route to any pool, whose replica answers it (a 404 for a name nobody serves).
-- x-prefix-key: a digest of a completion's model and the leading part of its first prompt
--   (its first PREFIX_CHARS bytes of text, or first PREFIX_TOKENS token ids), or of a chat's
--   model and the text of its messages in order (a conversation's turns share it): Envoy
--   hashes it to pick the replica. Any x-prefix-key a client sent is dropped.
-- x-prefix-path: for the replica picker (PREFIX_PATH), "BASE LENGTH KEY...": the prompt's
--   length (bytes of text, or token ids) and digests of its first BASE, 1.5 BASE, 2 BASE,
--   3 BASE, 4 BASE, ... units (facade/picker/policy.py's level_depth), up to its whole length
--   or PATH_LEVELS keys: the picker reads from them how much of the prompt earlier prompts
--   shared. One a client sent is dropped.
-- x-cancel-request-id: a CancelCompletion's request id (when it looks like one: at most 128
--   characters of [A-Za-z0-9._:/+=-], what the replicas accept as an id), for the picker, which
--   sends the cancel to the replica that holds the request. One a client sent is dropped.
-- x-gateway-destination-endpoint: only the replica picker (facade/picker) sets it, after this
--   filter; one a client sent is dropped, so that no caller can pin a replica.
--
-- These headers reach the replica as gRPC metadata too, so they stay short: a request's own
-- values (a 100,000-character model name) must not push it past the replica's metadata limit.

local EXTRACTION = "envoy.filters.http.grpc_field_extraction"
local MAX_MODEL_BYTES = 256
-- The path's first depth, and its deepest (25 levels): 64 bytes of text (about 16 tokens) to
-- 256 KiB, 16 token ids to 64 Ki.
local PATH_TEXT_BASE = 64
local PATH_IDS_BASE = 16
local PATH_LEVELS = 25
local FNV_OFFSET = bit.tobit(2166136261)

-- FNV-1a, 32 bits, in LuaJIT's bit operations (16777619 = 2^24 + 403, multiplied in two
-- parts so that no product leaves the exact range of a double).
local function mix_byte(hash, byte)
  hash = bit.bxor(hash, byte)
  return bit.tobit(bit.lshift(hash, 24) + hash * 403)
end

local function mix(hash, text)
  for i = 1, #text do
    hash = mix_byte(hash, string.byte(text, i))
  end
  return hash
end

local function digest(text)
  return bit.tohex(mix(FNV_OFFSET, text))
end

-- Units covered at each level of a path: base, 1.5 base, 2 base, 3 base, 4 base, ...
local function level_depth(base, level)
  local doubled = base * 2 ^ math.floor(level / 2)
  if level % 2 == 0 then
    return doubled
  end
  return doubled * 3 / 2
end

-- "BASE LENGTH KEY...": the running digest of `seed` and then each unit, taken after the
-- level_depth(BASE, 0)-th, level_depth(BASE, 1)-th, ... unit and after the last one.
-- mix_units(hash, from, to) mixes units from..to in (bytes of text, or token ids).
local function path(seed, count, mix_units, base)
  local last = math.min(count, level_depth(base, PATH_LEVELS - 1))
  local hash = mix(FNV_OFFSET, seed)
  local keys = {}
  local done = 0
  while done < last do
    local depth = math.min(level_depth(base, #keys), last)
    hash = mix_units(hash, done + 1, depth)
    keys[#keys + 1] = bit.tohex(hash)
    done = depth
  end
  if #keys == 0 then
    return nil
  end
  return base .. " " .. count .. " " .. table.concat(keys, " ")
end

local function mix_bytes(text)
  return function(hash, from, to)
    for i = from, to do
      hash = mix_byte(hash, string.byte(text, i))
    end
    return hash
  end
end

-- A token id's four bytes, low to high (ids are below 2^31).
local function mix_ids(tokens)
  return function(hash, from, to)
    for i = from, to do
      local id = tokens[i]
      for shift = 0, 24, 8 do
        hash = mix_byte(hash, bit.band(bit.rshift(id, shift), 255))
      end
    end
    return hash
  end
end

local function first(list)
  return list and list[1]
end

-- The first prompt: its text, or else its token ids, and whether those are a batch's, all its
-- prompts' ids in one list (the field extraction does not keep where each one ends).
local function first_prompt(fields)
  local messages = fields["messages.content.string_value"]
  if messages ~= nil and messages[1] ~= nil then
    -- A chat: its messages' text, each ended, so that "ab" + "c" and "a" + "bc" differ.
    return "chat:" .. table.concat(messages, "\n\0") .. "\n\0", nil, false
  end
  local text = first(fields["prompt.string_value"])
    or first(fields["prompt.list_value.values.string_value"])
  if text ~= nil then
    return text, nil, false
  end
  local tokens = fields["prompt.list_value.values.number_value"]
  if tokens ~= nil and tokens[1] ~= nil then
    return nil, tokens, false
  end
  tokens = fields["prompt.list_value.values.list_value.values.number_value"]
  if tokens ~= nil and tokens[1] ~= nil then
    return nil, tokens, true
  end
  return nil, nil, false
end

local function leading_part(text, tokens)
  if text ~= nil then
    return "text:" .. string.sub(text, 1, PREFIX_CHARS)
  end
  local ids = {}
  for i = 1, math.min(#tokens, PREFIX_TOKENS) do
    ids[i] = tokens[i]
  end
  return "ids:" .. table.concat(ids, ",")
end

-- A batch's ids go on past its first prompt, so its path stops where the key does, as if the
-- first prompt were PREFIX_TOKENS ids long.
local function prompt_path(model, text, tokens, batch)
  if text ~= nil then
    return path(model .. "\ntext:", #text, mix_bytes(text), PATH_TEXT_BASE)
  end
  local count = batch and math.min(#tokens, PREFIX_TOKENS) or #tokens
  return path(model .. "\nids:", count, mix_ids(tokens), PATH_IDS_BASE)
end

function envoy_on_request(handle)
  local headers = handle:headers()
  local fields = handle:streamInfo():dynamicMetadata():get(EXTRACTION) or {}
  -- An adapter's load or unload names no model: its adapter's name routes it to a pool.
  local model = first(fields["model"]) or first(fields["lora_name"])
  if model ~= nil and #model > MAX_MODEL_BYTES then
    model = nil
  end
  if model ~= nil then
    headers:replace("x-model", model)
  else
    headers:remove("x-model")
  end
  local text, tokens, batch = nil, nil, false
  if model ~= nil and PREFIX_CHARS > 0 then
    text, tokens, batch = first_prompt(fields)
  end
  local keyed = text ~= nil or tokens ~= nil
  if keyed then
    headers:replace("x-prefix-key", digest(model .. "\n" .. leading_part(text, tokens)))
  else
    headers:remove("x-prefix-key")
  end
  local prompt_keys = keyed and PREFIX_PATH and prompt_path(model, text, tokens, batch)
  if prompt_keys then
    headers:replace("x-prefix-path", prompt_keys)
  else
    headers:remove("x-prefix-path")
  end
  local cancelled = first(fields["request_id"])
  if cancelled ~= nil and #cancelled <= 128 and string.find(cancelled, "^[%w._:/+=-]+$") then
    headers:replace("x-cancel-request-id", cancelled)
  else
    headers:remove("x-cancel-request-id")
  end
  headers:remove("x-gateway-destination-endpoint")
  handle:clearRouteCache()
end
