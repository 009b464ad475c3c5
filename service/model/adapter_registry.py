"""The adapters a replica serves while it runs: those given at start, those in the adapter root
(loaded into the engine on a request's first use), and those loaded by call.

Every call on an adapter holds a lease on the version it started with. A version leaves the
engine only when it is retired (unloaded, its directory removed or changed, replaced) and no
call holds it any more, or, past the drain deadline, after its remaining calls were ended. A
version is a snapshot of the adapter's files with its own engine id, so changed weights under
one name never meet the old version's weights or prefix-cache blocks (vLLM keys both by the
adapter's id, name and path). Adapters not in use are evicted, least recently used first, to
make room in the engine's memory (vLLM's max_cpu_loras)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from vllm.lora.peft_helper import PEFTHelper
from vllm.lora.request import LoRARequest
from vllm.v1.engine.async_llm import AsyncLLM

from service.model import adapter_files
from service.model.adapter_checks import (
    ADAPTER_CONFIG,
    AdapterError,
    AdapterInvalidError,
    AdapterNameTakenError,
    AdapterNotFoundError,
    check_adapter,
    quote,
)
from service.model.adapter_targets import engine_targets
from service.model.adapters import ModelCatalog, UnknownModelError
from service.settings import EngineSettings, LoraModule

logger = logging.getLogger(__name__)

# How long the calls an expired drain ended have to notice before the engine's copy goes.
ENDED_CALLS_GRACE_SECONDS = 5.0
# How long a call for an adapter not in the engine waits for one there to finish its calls.
SLOT_WAIT_SECONDS = 30.0
START, ROOT, CALL = "start", "root", "call"  # where a version came from
MAX_NAME_BYTES = 255  # a directory name's limit on common file systems


class AdapterOutsideRootError(AdapterError):
    """A load path outside the adapter root (or relative, which vLLM would download)."""


class AdapterCapacityError(AdapterError):
    """Over the adapters loaded by call, one adapter's bytes, or every engine slot busy."""


class AdapterFromRootError(AdapterError):
    """An unload of an adapter the root serves: it goes when its directory does."""


EndCall = Callable[[str], Awaitable[None]]  # ends a call, with a reason, at a drain deadline


@dataclass(eq=False)
class AdapterVersion:
    name: str
    request: LoRARequest
    origin: str  # START, ROOT or CALL
    source: Path
    signature: adapter_files.Signature = ()
    snapshot: Path | None = None  # the copy the engine reads; removed once retired
    leases: set[Lease] = field(default_factory=set)
    idle: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self.idle.set()


@dataclass(eq=False)
class Lease:
    """A call's hold on the adapter version it runs with (`request` None: the base model)."""

    request: LoRARequest | None
    version: AdapterVersion | None = None
    end_call: EndCall | None = None

    def release(self) -> None:
        if self.version is not None:
            self.version.leases.discard(self)
            if not self.version.leases:
                self.version.idle.set()


class AdapterRegistry:
    def __init__(
        self,
        engine: AsyncLLM,
        catalog: ModelCatalog,
        settings: EngineSettings,
        model_dir: Path,
        snapshots: Path,
        shared_snapshots: bool = False,
    ) -> None:
        self.engine = engine
        self.catalog = catalog
        self.settings = settings
        self.model_dir = model_dir
        # Where the copies the engine reads go; shared by a replica's frontends (the same
        # files then have the same path, and so the same prefix-cache blocks, in all of them),
        # in which case one frontend never removes a copy another may still use.
        self.snapshots = snapshots
        self.shared_snapshots = shared_snapshots
        self.root = settings.adapter_root.resolve() if settings.adapter_root else None
        self.active: dict[str, AdapterVersion] = {
            name: AdapterVersion(name, request, START, Path(request.lora_path))
            for name, request in catalog.adapters.items()
        }
        # Runtime versions in the engine, least recently used first.
        self.resident: OrderedDict[int, AdapterVersion] = OrderedDict()
        self.capacity = max(settings.resident_adapters - len(catalog.adapters), 1)
        self.root_names: list[str] = self.scan_root()
        self.lock = asyncio.Lock()  # engine loads and evictions, one at a time
        self.retiring: set[asyncio.Task[None]] = set()
        self.loading: dict[str, asyncio.Future[AdapterVersion]] = {}
        # Told each time an adapter enters (True) or leaves (False) the engine's memory.
        self.on_residency: Callable[[str, bool], None] = lambda name, held: None

    @property
    def names(self) -> list[str]:
        """Every name a request's `model` may be: the base model's, then the adapters'."""
        listed = dict.fromkeys([self.catalog.base, *self.active, *self.root_names])
        return list(listed)

    def serves(self, name: str) -> bool:
        return name == self.catalog.base or name in self.active or self.in_root(name)

    def check_served(self, name: str) -> None:
        if not self.serves(name):
            raise UnknownModelError(name)

    def resident_names(self) -> list[str]:
        """The adapters in the engine's memory now."""
        given = [version.name for version in self.active.values() if version.origin == START]
        return [*given, *(version.name for version in self.resident.values())]

    # Calls

    async def acquire(self, name: str, end_call: EndCall | None = None) -> Lease:
        """A lease on what a call for `name` runs with, the adapter loaded into the engine if
        it was not; UnknownModelError for a name not served."""
        if name == self.catalog.base:
            return Lease(self.catalog.base_adapter)
        for _ in range(2):  # once more if a new version replaced it meanwhile
            version = self.active.get(name) or await self.load_from_root(name)
            lease = Lease(version.request, version, end_call)
            version.leases.add(lease)
            version.idle.clear()
            try:
                await self.make_resident(version)
            except BaseException:
                lease.release()
                raise
            if self.active.get(name) is version:
                return lease
            lease.release()
        raise UnknownModelError(name)

    async def make_resident(self, version: AdapterVersion) -> None:
        """Into the engine's memory, evicting the least recently used idle adapter if it is
        full; while every adapter there runs calls, wait for one to finish."""
        if version.origin == START:
            return
        waited = 0.0
        while True:
            async with self.lock:
                adapter_id = version.request.lora_int_id
                if adapter_id in self.resident:  # this version, or another with the same files
                    self.resident[adapter_id] = version
                    self.resident.move_to_end(adapter_id)
                    return
                idle = [held for held in self.resident.values() if not held.leases]
                if len(self.resident) < self.capacity or idle:
                    if len(self.resident) >= self.capacity:
                        await self.evict(idle[0])
                    await self.add_to_engine(version)
                    self.resident[adapter_id] = version
                    self.on_residency(version.name, True)
                    return
                busy = list(self.resident.values())
            if waited >= SLOT_WAIT_SECONDS:
                raise AdapterCapacityError(
                    f"adapter {quote(version.name)}: all {self.capacity} adapter slots in the "
                    f"engine's memory ran calls for {SLOT_WAIT_SECONDS:g}s; retry, or raise "
                    "--max-cpu-loras"
                )
            started = asyncio.get_running_loop().time()
            await any_idle(busy, SLOT_WAIT_SECONDS - waited)
            waited += asyncio.get_running_loop().time() - started

    async def evict(self, victim: AdapterVersion) -> None:
        del self.resident[victim.request.lora_int_id]
        await self.engine.remove_lora(victim.request.lora_int_id)
        self.on_residency(victim.name, False)
        logger.info("adapter evicted from memory: %s (least recently used)", victim.name)

    async def add_to_engine(self, version: AdapterVersion) -> None:
        try:
            await self.engine.add_lora(version.request)
        except Exception as error:
            reason = str(error).strip().splitlines()[0] if str(error).strip() else repr(error)
            raise AdapterInvalidError(
                f"adapter {quote(version.name)}: the engine could not load it: {reason}"
            ) from None

    # The adapter root

    def in_root(self, name: str) -> bool:
        if self.root is None or not is_directory_name(name):
            return False
        try:
            return (self.root / name / ADAPTER_CONFIG).is_file()
        except OSError:  # a name no directory can have (too long, a NUL, ...)
            return False

    def scan_root(self) -> list[str]:
        if self.root is None or not self.root.is_dir():
            return []
        return sorted(
            entry.name
            for entry in self.root.iterdir()
            if is_directory_name(entry.name) and (entry / ADAPTER_CONFIG).is_file()
        )

    async def load_from_root(self, name: str) -> AdapterVersion:
        if not self.in_root(name):
            raise UnknownModelError(name)
        assert self.root is not None
        pending = self.loading.get(name)
        if pending is None:  # the first call loads it; calls meanwhile wait for that load
            pending = asyncio.ensure_future(self.prepare(name, self.root / name, ROOT))
            self.loading[name] = pending
            pending.add_done_callback(lambda _: self.loading.pop(name, None))
        version = await asyncio.shield(pending)
        if name not in self.active:
            self.active[name] = version
            logger.info("adapter found in the root: %s (%s)", name, version.source)
        return self.active[name]

    async def sync_root(self) -> None:
        """Retire the root's adapters whose directory was removed or changed (a changed one is
        loaded again, as a new version, on its next use)."""
        self.root_names = await asyncio.to_thread(self.scan_root)
        for name, version in list(self.active.items()):
            if version.origin != ROOT:
                continue
            now = await asyncio.to_thread(adapter_files.signature, version.source)
            if name not in self.root_names or now != version.signature:
                del self.active[name]
                change = "removed" if name not in self.root_names else "changed"
                logger.info("adapter retired: %s (its directory was %s)", name, change)
                self.retire_later(version)

    async def watch_root(self, interval: float = 1.0) -> None:
        while True:
            await asyncio.sleep(interval)
            try:
                await self.sync_root()
            except Exception:
                logger.exception("adapter root: scan failed; retrying")

    # Load and unload by call

    async def load(self, name: str, path: str, replace: bool = False) -> AdapterVersion:
        """Load the adapter at `path` (inside the root) as `name`; with `replace`, as the new
        version of an adapter loaded by call under that name."""
        current = self.active.get(name)
        if current is not None and self.same_load(current, path):
            return current  # loaded already (a retried call, or every replica asked again)
        replacing = replace and current is not None and current.origin == CALL
        if name == self.catalog.base or (current is not None and not replacing):
            raise AdapterNameTakenError(
                f"adapter {quote(name)}: the name is taken (by the base model or another "
                "adapter); unload it first, or load with load_inplace to replace it"
            )
        if self.in_root(name):
            raise AdapterNameTakenError(
                f"adapter {quote(name)}: the adapter root serves that name; change its "
                "directory there instead"
            )
        source = self.confined(name, path)
        loaded = sum(version.origin == CALL for version in self.active.values())
        if not replacing and loaded >= self.settings.max_adapters:
            raise AdapterCapacityError(
                f"adapter {quote(name)}: {loaded} adapters are loaded by call, the most "
                "--max-adapters allows; unload one first"
            )
        version = await self.prepare(name, source, CALL)
        try:
            await self.make_resident(version)
        except AdapterError:
            self.remove_snapshot(version)
            raise
        if current is not None:
            self.retire_later(current)
        self.active[name] = version
        logger.info("adapter loaded by call: %s (%s)", name, source)
        return version

    def same_load(self, version: AdapterVersion, path: str) -> bool:
        """Whether `version` was loaded by call from `path` and its files are unchanged."""
        if version.origin != CALL or not Path(path).is_absolute():
            return False
        source = Path(path).resolve()
        return source == version.source and adapter_files.signature(source) == version.signature

    async def unload(self, name: str, drain_seconds: float) -> None:
        """New calls for `name` are refused now; returns once its running calls ended (past
        `drain_seconds`, ended with an error) and the engine's copy is gone."""
        version = self.active.get(name)
        if version is None and not self.in_root(name):
            raise AdapterNotFoundError(f"adapter {quote(name)} is not loaded")
        if version is None or version.origin == ROOT:
            raise AdapterFromRootError(
                f"adapter {quote(name)} is served from the adapter root: remove its directory "
                "there to retire it"
            )
        del self.active[name]
        logger.info("adapter unloaded by call: %s", name)
        await self.retire(version, drain_seconds)

    def confined(self, name: str, path: str) -> Path:
        """The directory `path` names, if it is inside the adapter root (symlinks followed)."""
        given = Path(path)
        if self.root is None:
            raise AdapterOutsideRootError(
                f"adapter {quote(name)}: loading by path needs an adapter root (--adapter-root)"
            )
        if not given.is_absolute():
            raise AdapterOutsideRootError(
                f"adapter {quote(name)}: lora_path must be an absolute path inside the adapter "
                f"root {self.root}"
            )
        try:
            resolved = given.resolve()
            inside = resolved.is_relative_to(self.root)
            found = inside and resolved.is_dir()
        except (OSError, ValueError):  # no path a file system takes (a NUL, too long)
            raise AdapterNotFoundError(
                f"adapter {quote(name)}: {quote(path)} is not a directory"
            ) from None
        if not inside:
            raise AdapterOutsideRootError(
                f"adapter {quote(name)}: {path} is outside the adapter root {self.root}"
            )
        if not found:
            raise AdapterNotFoundError(f"adapter {quote(name)}: {path} is not a directory")
        return resolved

    async def prepare(self, name: str, source: Path, origin: str) -> AdapterVersion:
        """A new version of the adapter in `source`: checked, and its snapshot taken."""
        await asyncio.to_thread(self.check, name, source)
        signature = await asyncio.to_thread(adapter_files.signature, source)
        copy, content = await asyncio.to_thread(
            adapter_files.snapshot, source, self.snapshots, name
        )
        request = LoRARequest(name, adapter_files.engine_id(name, content), str(copy))
        return AdapterVersion(name, request, origin, source, signature, copy)

    def check(self, name: str, source: Path) -> None:
        check_adapter(LoraModule(name, source), self.settings.max_lora_rank, self.model_dir)
        size = adapter_files.total_bytes(source)
        if size > self.settings.max_adapter_bytes:
            raise AdapterCapacityError(
                f"adapter {quote(name)}: its files take {size} bytes, over "
                f"--max-adapter-bytes {self.settings.max_adapter_bytes}"
            )
        lora_config = self.engine.vllm_config.lora_config
        try:
            helper = PEFTHelper.from_local_dir(str(source), self.engine.model_config.max_model_len)
            if lora_config is not None:
                helper.validate_legal(lora_config)
        except (ValueError, TypeError, KeyError) as error:
            raise AdapterInvalidError(f"adapter {quote(name)}: {error}") from None
        if (targets := engine_targets(self.engine.vllm_config)) is not None:
            targets.check(LoraModule(name, source))

    # Retiring

    def retire_later(self, version: AdapterVersion) -> None:
        task = asyncio.create_task(self.retire(version, self.settings.adapter_drain_seconds))
        self.retiring.add(task)
        task.add_done_callback(self.retiring.discard)

    async def retire(self, version: AdapterVersion, drain_seconds: float) -> None:
        if not await wait_idle(version, drain_seconds):
            reason = f"adapter {quote(version.name)} was unloaded while this call ran"
            for lease in list(version.leases):
                if lease.end_call is not None:
                    await lease.end_call(reason)
            if not await wait_idle(version, ENDED_CALLS_GRACE_SECONDS):
                logger.warning("adapter %s: calls still hold it; removing it", version.name)
        async with self.lock:
            adapter_id = version.request.lora_int_id
            if self.shares_files(version):
                return  # a newer version with the same files serves on
            if self.resident.get(adapter_id) is version or version.origin == START:
                self.resident.pop(adapter_id, None)
                await self.engine.remove_lora(adapter_id)
                self.on_residency(version.name, False)
        self.remove_snapshot(version)

    def shares_files(self, version: AdapterVersion) -> bool:
        """Whether an active version has the same files (so the same engine id and copy)."""
        return any(
            other is not version and other.request.lora_int_id == version.request.lora_int_id
            for other in self.active.values()
        )

    def remove_snapshot(self, version: AdapterVersion) -> None:
        if self.shared_snapshots:
            return  # removed with the replica's scratch directory
        if version.snapshot is not None and not self.shares_files(version):
            shutil.rmtree(version.snapshot, ignore_errors=True)

    async def close(self) -> None:
        for task in list(self.retiring):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def any_idle(versions: list[AdapterVersion], seconds: float) -> None:
    """Returns once any of `versions` runs no call, or after `seconds`."""
    waits = [asyncio.ensure_future(version.idle.wait()) for version in versions]
    try:
        await asyncio.wait(waits, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for wait in waits:
            wait.cancel()


async def wait_idle(version: AdapterVersion, seconds: float) -> bool:
    try:
        await asyncio.wait_for(version.idle.wait(), seconds)
    except TimeoutError:
        return False
    return True


def is_directory_name(name: str) -> bool:
    """A name that is one directory's name inside the root (no path, nothing hidden)."""
    return (
        0 < len(name.encode(errors="replace")) <= MAX_NAME_BYTES
        and not any(c in name for c in "/\\\0")
        and not name.startswith(".")
    )
