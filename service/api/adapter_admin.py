"""LoadLoraAdapter and UnloadLoraAdapter: the operator's calls that change which adapters the
replica serves (who may call them is the transport's check)."""

from __future__ import annotations

from dataclasses import dataclass

from llmcompletions.v2.completions_pb2 import (
    LoadLoraAdapterRequest,
    LoadLoraAdapterResponse,
    UnloadLoraAdapterRequest,
    UnloadLoraAdapterResponse,
)

from service.api.endpoint_models import adapter_call_error
from service.api.errors import (
    AdapterPreconditionCallError,
    FieldViolation,
    RequestValidationError,
)
from service.model.adapter_checks import AdapterError
from service.model.engine import ServedModel

LOADED, UNLOADED = "lora_adapter.loaded", "lora_adapter.unloaded"
AdapterReply = LoadLoraAdapterResponse | UnloadLoraAdapterResponse


@dataclass(frozen=True)
class AdapterAdmin:
    model: ServedModel
    enabled: bool  # --enable-adapter-loading
    drain_seconds: float  # how long an unload lets the adapter's calls run

    async def load(self, request: LoadLoraAdapterRequest) -> LoadLoraAdapterResponse:
        self.check_enabled()
        require(lora_name=request.lora_name, lora_path=request.lora_path)
        try:
            await self.model.adapters.load(
                request.lora_name, request.lora_path, replace=request.load_inplace
            )
        except AdapterError as error:
            raise adapter_call_error(error) from None
        return LoadLoraAdapterResponse(lora_name=request.lora_name, object=LOADED, replicas=1)

    async def unload(self, request: UnloadLoraAdapterRequest) -> UnloadLoraAdapterResponse:
        self.check_enabled()
        require(lora_name=request.lora_name)
        try:
            await self.model.adapters.unload(request.lora_name, self.drain_seconds)
        except AdapterError as error:
            raise adapter_call_error(error) from None
        return UnloadLoraAdapterResponse(lora_name=request.lora_name, object=UNLOADED, replicas=1)

    def check_enabled(self) -> None:
        if not self.enabled:
            raise AdapterPreconditionCallError(
                "Adapter loading is off on this server: start it with --enable-adapter-loading "
                "(ENABLE_ADAPTER_LOADING=1)."
            )


def require(**fields: str) -> None:
    missing = [
        FieldViolation((name,), f"{name} is required", "missing")
        for name, value in fields.items()
        if not value
    ]
    if missing:
        raise RequestValidationError(missing)
