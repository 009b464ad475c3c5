-- Routes a call to the pool serving its `model` (used when the facade has several pools).
--
-- Runs after the transcoder, so REST and gRPC calls look alike here: the gRPC field
-- extraction filter before this one has read `model` from the request message into dynamic
-- metadata. This copies it into the x-model header, which each pool's routes match, and has
-- Envoy choose the route again. A call without a model (ListModels) loses any x-model a
-- client sent and takes the route to any pool.

local EXTRACTION = "envoy.filters.http.grpc_field_extraction"

function envoy_on_request(handle)
  local headers = handle:headers()
  local extracted = handle:streamInfo():dynamicMetadata():get(EXTRACTION)
  local models = extracted and extracted["model"]
  if models ~= nil and models[1] ~= nil then
    headers:replace("x-model", models[1])
  else
    headers:remove("x-model")
  end
  handle:clearRouteCache()
end
