-- The endpoint that served a request, for the replica picker, as the endpoint picker protocol
-- has a gateway report it: in the response's metadata `envoy.lb`, key
-- `x-gateway-destination-endpoint-served`. Envoy's header mutation filter (after this one)
-- writes the upstream host into the header below; this filter moves it into the metadata, so
-- that the picker's ext_proc filter (before this one) forwards it, and no caller sees it.
local SERVED = "x-gateway-destination-endpoint-served"

function envoy_on_response(handle)
  local headers = handle:headers()
  local served = headers:get(SERVED)
  if served ~= nil then
    headers:remove(SERVED)
    if string.find(served, ":%d+$") then
      handle:streamInfo():dynamicMetadata():set("envoy.lb", SERVED, served)
    end
  end
end
