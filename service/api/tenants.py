"""The tenants table: who may call (keys, stored as SHA-256 hashes only), which models each
tenant may reach (fnmatch patterns over served names and adapters) and its limits per minute.

Read from a YAML file (`--tenants-file`):

    version: 1
    tenants:
      team-a:
        keys: [{id: a-2026-12, sha256: "<hex sha256 of the bearer key>"}]
        models: ["smollm2-*"]              # omitted: every model
        limits: {rpm: 600, tpm: 200000}    # per minute; omitted: unlimited
        operator: false                    # true: its keys may load and unload adapters
"""

from __future__ import annotations

import contextvars
import fnmatch
import hashlib
import hmac
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Annotated, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationError,
    model_validator,
)

TenantId = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")]
KeyHash = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]


class TenantsFileError(ValueError):
    """A tenants file that cannot be used; the message says where and why."""


class KeyEntry(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    id: Annotated[str, StringConstraints(min_length=1, max_length=64)]
    sha256: KeyHash


class Limits(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    rpm: int | None = Field(default=None, ge=1)  # requests a minute
    tpm: int | None = Field(default=None, ge=1)  # prompt + completion tokens a minute


class TenantEntry(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    keys: list[KeyEntry] = Field(min_length=1)
    models: list[Annotated[str, StringConstraints(min_length=1)]] | None = None
    limits: Limits = Limits()
    operator: bool = False  # its keys may load and unload adapters

    @model_validator(mode="after")
    def key_ids_are_unique(self) -> TenantEntry:
        ids = [key.id for key in self.keys]
        if len(set(ids)) != len(ids):
            raise ValueError("a key id appears twice")
        return self


class TenantsDocument(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    version: Literal[1]
    tenants: dict[TenantId, TenantEntry]

    @model_validator(mode="after")
    def each_key_has_one_tenant(self) -> TenantsDocument:
        owners: dict[str, str] = {}
        for tenant, entry in self.tenants.items():
            for key in entry.keys:
                if owners.setdefault(key.sha256, tenant) != tenant:
                    raise ValueError(f"a key of {tenant!r} is also {owners[key.sha256]!r}'s")
        return self


@dataclass(frozen=True)
class Caller:
    """A tenant's key, as presented on a call."""

    tenant: str
    key_id: str
    models: tuple[str, ...] | None  # fnmatch patterns; None: every model
    limits: Limits
    operator: bool = False  # may load and unload adapters

    def may_use(self, model: str) -> bool:
        return self.models is None or any(fnmatch.fnmatchcase(model, p) for p in self.models)


def hash_key(key: str) -> str:
    """The hex SHA-256 of a bearer key, as the tenants file stores it."""
    return hashlib.sha256(key.encode()).hexdigest()


@dataclass(frozen=True)
class TenantTable:
    """Every tenant's keys, by hash."""

    callers: tuple[tuple[str, Caller], ...] = ()  # (key hash, caller)

    @property
    def tenants(self) -> set[str]:
        return {caller.tenant for _, caller in self.callers}

    def find(self, presented: str | None) -> Caller | None:
        """The caller whose key was presented, if any. Every hash is compared, each in
        constant time, so that timing reveals neither which key matched nor how much."""
        if presented is None:
            return None
        digest = hash_key(presented).encode()
        found = None
        for stored, caller in self.callers:
            if hmac.compare_digest(digest, stored.encode()):
                found = caller
        return found

    def of(self, tenant: str, key_id: str) -> Caller | None:
        """The tenant's caller by key id (else by any key of the tenant's): a batch job's
        lines run as the key that created it."""
        mine = [caller for _, caller in self.callers if caller.tenant == tenant]
        return next((caller for caller in mine if caller.key_id == key_id), None) or (
            mine[0] if mine else None
        )


def parse_tenants(text: str, source: str) -> TenantTable:
    """The table a tenants file's text describes; TenantsFileError naming what is wrong."""
    try:
        document = TenantsDocument.model_validate(yaml.safe_load(text))
    except yaml.YAMLError as error:
        raise TenantsFileError(f"{source}: not YAML: {error}") from None
    except ValidationError as error:
        problems = "; ".join(
            f"{'.'.join(map(str, e['loc'])) or 'top level'}: {e['msg']}" for e in error.errors()
        )
        raise TenantsFileError(f"{source}: {problems}") from None
    return TenantTable(
        tuple(
            (key.sha256, Caller(tenant, key.id, patterns(entry), entry.limits, entry.operator))
            for tenant, entry in document.tenants.items()
            for key in entry.keys
        )
    )


def patterns(entry: TenantEntry) -> tuple[str, ...] | None:
    """The tenant's model patterns; None (every model) only when it lists none at all."""
    return None if entry.models is None else tuple(entry.models)


# The tenant's key on the current call (None: no tenants file, or an API_KEY key).
_caller: contextvars.ContextVar[Caller | None] = contextvars.ContextVar("caller", default=None)


def bind_caller(caller: Caller | None) -> contextvars.Token[Caller | None]:
    return _caller.set(caller)


def unbind_caller(token: contextvars.Token[Caller | None]) -> None:
    _caller.reset(token)


def current_caller() -> Caller | None:
    return _caller.get()


def may_use(model: str) -> bool:
    """Whether the current call's caller may reach `model` (any caller without a tenant may)."""
    caller = _caller.get()
    return caller is None or caller.may_use(model)


def visible(names: Iterable[str]) -> list[str]:
    """The names the current call's caller may see, in their order."""
    return [name for name in names if may_use(name)]
