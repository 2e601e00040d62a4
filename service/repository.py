"""Models managed at run time: loaded and unloaded without a restart, on demand from a
repository, the least recently used evicted to make room.

`ModelManager` knows every model the server may serve: those given with --model (pinned:
never evicted), those of --model-repository (a folder of model folders, or a JSON or YAML
file mapping names to sources), and those an admin loaded by name and source. Each is in
one state (`ModelState`). The engine's routing table stays the one place a call resolves
its model (engine/scheduling/engine.py); this module only adds to and takes from it.

- A load runs off the event loop and off every other model's batching path: weights are
  read on a worker thread (single process) or in the engine processes (split server),
  and the new queue's workers warm the model on their own threads. Only once warm is it
  routed to. Loads take turns (one device, one budget); concurrent requests for the same
  model share its one load, each waiting within its own deadline.
- A load that fails is remembered for --failed-load-ttl-s: requests naming the model are
  refused at once with MODEL_LOAD_FAILED rather than each retrying the load.
- An unload takes the model out of routing first; the calls already resolved finish
  (ModelUse.drained), then its queue stops and its memory is handed back.
- Before a load, while --max-loaded-models or --model-memory-gb would be passed, the
  loaded model used least recently with no call in flight is unloaded (evicted).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import msgspec
from prometheus_client import CollectorRegistry, Counter, Histogram

from pooling_server.engine.errors import ErrorKind, FieldViolation, PoolingError, clip
from pooling_server.engine.models.model_spec import ModelSpec
from pooling_server.engine.models.served import ModelDescription, ServedModel
from pooling_server.service.adapters import BASE_MODEL, AdapterManager
from pooling_server.service.engine_notices import Notices
from pooling_server.service.ops.config import ServerConfig
from pooling_server.service.split.layout import weight_bytes

if TYPE_CHECKING:
    from pooling_server.engine.scheduling.engine import Engine
    from pooling_server.engine.scheduling.ipc import ModelChanged
    from pooling_server.engine.scheduling.remote_client import RemoteEngineClient

log = logging.getLogger(__name__)

# The per-model flags a Load call may set (service/cli.py parses them as for --model),
# and --dtype, which a run-time load may choose per model.
LOAD_OPTIONS = frozenset(
    {
        "pooling-type",
        "truncation-side",
        "long-input",
        "max-input-chars",
        "hf-overrides",
        "default-prompt-name",
        "revision",
        "score-template",
        "score-tokens",
        "label-template",
        "backend",
        "backend-file",
        "quantize",
        "calibration-file",
        "trust-remote-code",
        "dtype",
    }
)
REPOSITORY_FILE_SUFFIXES = (".json", ".yaml", ".yml")
REFRESH_S = 1.0
LOAD_SECONDS_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class ModelState(StrEnum):
    AVAILABLE = "available"
    LOADING = "loading"
    LOADED = "loaded"
    FAILED = "failed"
    UNLOADING = "unloading"


@dataclass
class Entry:
    """One model the server knows, and where it stands."""

    name: str
    source: str
    options: dict[str, str] = field(default_factory=dict)
    pinned: bool = False  # given with --model
    on_demand: bool = False  # in --model-repository: a request naming it loads it
    state: ModelState = ModelState.AVAILABLE
    memory_bytes: int = 0
    reason: str = ""  # why its last load failed
    failed_until: float = 0.0  # time.monotonic() until which requests are refused at once
    load_seconds: float = 0.0
    loading: asyncio.Task[None] | None = None
    parent: str = ""  # a LoRA adapter's model (service/adapters.py); "" for a model

    def retry_after_s(self, now: float | None = None) -> float:
        if self.state is not ModelState.FAILED:
            return 0.0
        return max(0.0, self.failed_until - (time.monotonic() if now is None else now))


class ModelHost(Protocol):
    """Where a model's weights go: this process, or the engine processes."""

    async def load(
        self, entry: Entry, spec: ModelSpec, dtype: str | None
    ) -> tuple[ServedModel, int]:
        """The model loaded and warm wherever it computes; (its served side, its bytes)."""
        ...

    async def unload(self, name: str) -> None:
        """Its queue stopped and its memory handed back (nothing routes to it any more)."""
        ...


class LocalHost:
    """The one-process server: weights loaded on a worker thread, the queue started here."""

    def __init__(self, config: ServerConfig, engine: Engine, on_queue: Callable[..., None]) -> None:
        self.config = config
        self.engine = engine
        self.on_queue = on_queue  # metrics: the new queue's batches observed

    async def load(
        self, entry: Entry, spec: ModelSpec, dtype: str | None
    ) -> tuple[ServedModel, int]:
        from pooling_server.service.loading import (  # torch: only here
            load_aside,
            load_one,
            model_bytes,
        )

        batch = self.engine.batch_config
        loaded = await load_aside(load_one, self.config, spec, batch, False, dtype)
        try:
            queue = await self.engine.client.add_model(loaded)  # type: ignore[attr-defined]
        except BaseException:
            del loaded
            await self._release()
            raise
        self.on_queue(spec.served_name, queue)
        return loaded, model_bytes(loaded)

    async def unload(self, name: str) -> None:
        await self.engine.client.remove_model(name)  # type: ignore[attr-defined]
        await self._release()

    async def _release(self) -> None:
        from pooling_server.service.loading import release_memory

        await asyncio.to_thread(release_memory)


class RemoteHost:
    """A split server's front end: every engine process loads its copy over its link
    (engine/scheduling/core.py); the call answers once all have, or names which failed,
    and those that had loaded it unload it again, so no engine serves what others lack."""

    def __init__(self, engine: Engine, engines_per_device: int) -> None:
        self.engine = engine
        self.engines_per_device = engines_per_device

    @property
    def client(self) -> RemoteEngineClient:
        return self.engine.client  # type: ignore[return-value]

    async def load(
        self, entry: Entry, spec: ModelSpec, dtype: str | None
    ) -> tuple[ServedModel, int]:
        from pooling_server.engine.scheduling.ipc import LoadModel, UnloadModel

        name, source, options = entry.name, entry.source, entry.options
        answers = await self.client.manage(
            lambda key: LoadModel(key, name, source, options, entry.pinned)
        )
        failed = [(k, a.error) for k, a in answers if a.error is not None]
        if failed or not answers:
            loaded = [k for k, a in answers if a.error is None]
            if loaded:
                await self.client.manage(lambda key: UnloadModel(key, name), loaded)
            said = "; ".join(f"engine {k}: {e.message}" for k, e in failed if e is not None)
            raise PoolingError(
                ErrorKind.INTERNAL,
                "MODEL_LOAD_FAILED",
                f"{said or 'no engine is serving'}"
                + (f" (engines {loaded} had loaded it, and unloaded it again)" if loaded else ""),
            )
        served = await self.served(answers[0][1].description)
        return served, max(a.memory_bytes for _, a in answers)

    async def served(self, description: bytes) -> ServedModel:
        """A model's served side from an engine's description of it. The tokenizer and
        any image processor are read from the folder: off the loop."""
        decoded = msgspec.json.decode(description, type=ModelDescription)
        return await asyncio.to_thread(decoded.served, self.engines_per_device)

    async def unload(self, name: str) -> None:
        from pooling_server.engine.scheduling.ipc import UnloadModel

        for engine, answer in await self.client.manage(lambda key: UnloadModel(key, name)):
            if answer.error is not None:
                log.error("engine %d failed to unload %s: %s", engine, name, answer.error.message)


class RepositoryMetrics:
    """/metrics: loads (by outcome), unloads, evictions and load seconds, per model."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.loads = Counter(
            "pooling_model_loads",
            "Model loads at run time, by outcome (ok or failed)",
            ["model", "outcome"],
            registry=registry,
        )
        self.unloads = Counter(
            "pooling_model_unloads",
            "Models unloaded at run time (evictions included)",
            ["model"],
            registry=registry,
        )
        self.evictions = Counter(
            "pooling_model_evictions",
            "Models unloaded to make room for another (least recently used first)",
            ["model"],
            registry=registry,
        )
        self.load_seconds = Histogram(
            "pooling_model_load_seconds",
            "Time a run-time load took, weights read and model warm",
            ["model"],
            buckets=LOAD_SECONDS_BUCKETS,
            registry=registry,
        )


class ModelManager:
    def __init__(
        self,
        config: ServerConfig,
        engine: Engine,
        host: ModelHost,
        metrics: RepositoryMetrics | None = None,
        start_bytes: Mapping[str, int] | None = None,
    ) -> None:
        """`start_bytes`: what each --model's weights take, where known."""
        self.config = config
        self.engine = engine
        self.host = host
        self.metrics = metrics
        self._entries: dict[str, Entry] = {}
        for spec in config.models:
            name = spec.served_name
            entry = Entry(name, spec.source, pinned=True, state=ModelState.LOADED)
            entry.memory_bytes = (start_bytes or {}).get(name, 0)
            self._entries[name] = entry
        self._specs: dict[str, ModelSpec] = {spec.served_name: spec for spec in config.models}
        self._turn = asyncio.Lock()  # loads and evictions take turns
        # A split server's other front ends' loads and unloads, as the engines tell of
        # them (`learned`).
        self.notices = Notices(engine)
        self._draining: dict[str, Any] = {}
        # LoRA adapters: a Load naming `base-model`, an Unload naming an adapter.
        self.adapters = AdapterManager(engine, config.models, config.frontends, start_bytes)
        self.refresh()

    # ---------------------------------------------------------------- the catalog

    def refresh(self) -> None:
        """Read --model-repository again: models added to it since become available."""
        self._refreshed = time.monotonic()
        if not self.config.model_repository:
            return
        try:
            found = read_repository(self.config.model_repository)
        except (OSError, ValueError) as exc:
            log.error("cannot read --model-repository %s: %s", self.config.model_repository, exc)
            return
        for name, (source, options) in found.items():
            entry = self._entries.get(name)
            if entry is None:
                self._entries[name] = Entry(name, source, options, on_demand=True)
            elif entry.state is ModelState.AVAILABLE and not entry.pinned:
                entry.source, entry.options, entry.on_demand = source, options, True

    def entries(self) -> list[Entry]:
        """Every model known, loaded ones first, each group by name."""
        self.refresh()
        order = {ModelState.LOADED: 0, ModelState.UNLOADING: 1, ModelState.LOADING: 2}
        models = sorted(self._entries.values(), key=lambda e: (order.get(e.state, 3), e.name))
        return models + self.adapters.entries()

    def entry(self, name: str) -> Entry | None:
        return self._entries.get(name) or self.adapters.entry(name)

    def in_flight(self, name: str) -> int:
        use = self.engine.use.get(name)
        return use.in_flight if use is not None else 0

    # ------------------------------------------------------------------ on demand

    def knows(self, name: str) -> bool:
        """Whether a request naming `name` (not served now) may load it: a repository
        model. The repository is read again for a name it lacked, at most once a
        REFRESH_S: a flood of unknown names costs no folder listing each."""
        if name not in self._entries and time.monotonic() - self._refreshed >= REFRESH_S:
            self.refresh()
        entry = self._entries.get(name)
        return entry is not None and entry.on_demand

    async def ensure(self, name: str, deadline: float | None) -> None:
        """A request names `name`, which is not served: load it (or share the load under
        way), waiting within the request's deadline. A name the repository does not know
        is left to the engine to refuse as unknown."""
        if not self.knows(name):
            return
        entry = self._entries[name]
        if entry.state is ModelState.LOADED:
            return
        now = time.monotonic()
        if entry.state is ModelState.FAILED and now < entry.failed_until:
            raise load_failed(entry, now)
        task = self._start_load(entry)
        timeout = None if deadline is None else max(0.0, deadline - now)
        try:
            await asyncio.wait_for(asyncio.shield(task), timeout)
        except TimeoutError:
            raise PoolingError(
                ErrorKind.DEADLINE_EXCEEDED,
                "DEADLINE_EXCEEDED",
                f'the deadline passed while model "{clip(name)}" was loading; it loads on, '
                "retry shortly",
                retry_after_s=1.0,
            ) from None

    # --------------------------------------------------------------- admin calls

    async def load(self, name: str, source: str = "", options: Mapping[str, str] = ()) -> Entry:  # type: ignore[assignment]
        """Load `name` (from `source` with `options`, else its repository entry); answers
        once it is served. Loading a model already loaded from the same source answers it
        as it is; from another source, it is refused (unload it first). With option
        `base-model`, `source` is a LoRA adapter's folder, loaded onto that model."""
        check_name(name)
        options = dict(options or {})
        if BASE_MODEL in options:
            return await self.adapters.load(name, source, options[BASE_MODEL])
        entry = self._entries.get(name) or (self.refresh() or self._entries.get(name))
        if entry is None:
            if not source:
                raise not_in_repository(name)
            entry = self._entries[name] = Entry(name, source, options)
        elif source and (source != entry.source or options != entry.options):
            if entry.state in (ModelState.LOADED, ModelState.LOADING, ModelState.UNLOADING):
                raise PoolingError(
                    ErrorKind.FAILED_PRECONDITION,
                    "MODEL_ALREADY_LOADED",
                    f'model "{clip(name)}" is {entry.state} from {clip(entry.source)}; '
                    "unload it first",
                )
            entry.source, entry.options = source, options
            self._specs.pop(name, None)
        if entry.state is ModelState.UNLOADING:
            await self._settled(entry)
        if entry.state is not ModelState.LOADED:
            await asyncio.shield(self._start_load(entry, retry=True))
        return entry

    async def unload(self, name: str) -> Entry:
        """Out of routing, then its accepted calls finished, then its memory given back."""
        if name in self.engine.adapters:
            return await self.adapters.unload(name)
        entry = self._entries.get(name)
        if entry is not None and entry.loading is not None:
            await self._settled(entry)
        if entry is None or entry.state is not ModelState.LOADED:
            raise PoolingError(
                ErrorKind.NOT_FOUND,
                "MODEL_NOT_LOADED",
                f'model "{clip(name)}" is not loaded',
                (FieldViolation("name", "not a loaded model", "MODEL_NOT_LOADED"),),
            )
        async with self._turn:
            if entry.state is ModelState.LOADED:
                await self._unload(entry)
        return entry

    # ------------------------------------------------------------------- the work

    def _start_load(self, entry: Entry, retry: bool = False) -> asyncio.Task[None]:
        """The entry's one load task: made by the first caller, shared by the rest."""
        if entry.loading is None:
            if retry or entry.state is not ModelState.FAILED:
                entry.state = ModelState.LOADING
            entry.loading = asyncio.create_task(self._load(entry), name=f"load {entry.name}")
            entry.loading.add_done_callback(_retrieved)
        return entry.loading

    async def _settled(self, entry: Entry) -> None:
        """Wait for whatever load or unload of `entry` is under way, however it ends."""
        while entry.loading is not None or entry.state is ModelState.UNLOADING:
            if entry.loading is not None:
                await asyncio.wait({entry.loading})
            else:
                async with self._turn:  # an unload holds the turn while it runs
                    pass

    async def _load(self, entry: Entry) -> None:
        name = entry.name
        try:
            spec, dtype = self._spec_of(entry)
            async with self._turn:
                entry.state = ModelState.LOADING
                started = time.monotonic()
                estimate = weight_bytes([spec.source])
                await self._make_room(entry, estimate)
                log.info("loading model %s from %s", name, entry.source)
                served, size = await self.host.load(entry, spec, dtype)
                if not self.engine.serves(name):  # else learned from another front end
                    self.engine.add_model(served)
                entry.load_seconds = time.monotonic() - started
                entry.memory_bytes = size
                entry.state, entry.reason, entry.failed_until = ModelState.LOADED, "", 0.0
                self._specs[name] = spec
            log.info("model %s loaded in %.2fs (%d MB)", name, entry.load_seconds, size >> 20)
            if self.metrics is not None:
                self.metrics.loads.labels(name, "ok").inc()
                self.metrics.load_seconds.labels(name).observe(entry.load_seconds)
        except PoolingError as error:
            if error.kind in (ErrorKind.INVALID_ARGUMENT, ErrorKind.RESOURCE_EXHAUSTED):
                entry.state = ModelState.AVAILABLE  # nothing was wrong with the model
                if not (entry.on_demand or entry.pinned):
                    self._entries.pop(name, None)
                raise
            self._failed(entry, error.message)
            raise load_failed(entry) from None
        except Exception as exc:
            log.exception("model %s failed to load", name)
            self._failed(entry, f"{type(exc).__name__}: {exc}")
            raise load_failed(entry) from None
        finally:
            entry.loading = None

    def _failed(self, entry: Entry, reason: str) -> None:
        entry.state, entry.reason = ModelState.FAILED, clip(reason, 500)
        entry.failed_until = time.monotonic() + self.config.failed_load_ttl_s
        if self.metrics is not None:
            self.metrics.loads.labels(entry.name, "failed").inc()

    def _spec_of(self, entry: Entry) -> tuple[ModelSpec, str | None]:
        spec = self._specs.get(entry.name)
        if spec is not None and entry.pinned:
            return spec, None
        return load_spec(entry.name, entry.source, entry.options)

    async def _make_room(self, entry: Entry, estimate: int) -> None:
        """Evict the least recently used loaded models, none with calls in flight and none
        pinned, until one more model (of about `estimate` bytes) fits both bounds."""
        cap, budget = self.config.max_loaded_models, self.config.model_memory_bytes
        while True:
            loaded = [e for e in self._entries.values() if e.state is ModelState.LOADED]
            used = sum(e.memory_bytes for e in loaded)
            over_count = bool(cap) and len(loaded) + 1 > cap
            over_memory = bool(budget) and used + estimate > budget
            if not (over_count or over_memory):
                return
            candidates = [e for e in loaded if not e.pinned and not self.in_flight(e.name)]
            if not candidates:
                bound = "--max-loaded-models" if over_count else "--model-memory-gb"
                raise PoolingError(
                    ErrorKind.RESOURCE_EXHAUSTED,
                    "MODEL_CAPACITY",
                    f'cannot load model "{clip(entry.name)}": {bound} is reached and every '
                    "loaded model is pinned or has calls in flight; retry shortly",
                    retry_after_s=1.0,
                )
            victim = min(candidates, key=lambda e: self._last_used(e.name))
            log.info("evicting model %s (least recently used) for %s", victim.name, entry.name)
            if self.metrics is not None:
                self.metrics.evictions.labels(victim.name).inc()
            await self._unload(victim)

    def _last_used(self, name: str) -> float:
        use = self.engine.use.get(name)
        return use.last_used if use is not None else 0.0

    async def _unload(self, entry: Entry) -> None:
        """Under the turn: out of routing, drained, freed."""
        entry.state = ModelState.UNLOADING
        started = time.monotonic()
        try:
            if self.engine.serves(entry.name):  # else withdrawn for another front end
                use = self._draining[entry.name] = self.engine.remove_model(entry.name)
                await use.drained()
            await self.host.unload(entry.name)
        finally:
            self._draining.pop(entry.name, None)
            entry.state, entry.memory_bytes = ModelState.AVAILABLE, 0
            if not (entry.on_demand or entry.pinned):  # an admin's load, unloaded: gone
                self._entries.pop(entry.name, None)
        log.info("model %s unloaded in %.2fs", entry.name, time.monotonic() - started)
        if self.metrics is not None:
            self.metrics.unloads.labels(entry.name).inc()

    # ------------------------------------------- what other front ends did (split server)

    def learned(self, engine: int, change: ModelChanged) -> None:
        """On the loop: engine `engine` says another front end loaded `change.name` on it
        (with its description), or is unloading it (none). A load is routed here once
        every live engine has told of it; an unload is answered to each engine once the
        model is out of routing here and its calls are answered. An adapter's notice goes
        to the adapters' own (service/adapters.py)."""
        if change.adapter_on:
            self.adapters.learned(engine, change)
            return
        name = change.name
        if change.description:
            if self.notices.all_told(engine, name) and not self.engine.serves(name):
                task = asyncio.create_task(self._adopt(change), name=f"adopt {name}")
                task.add_done_callback(_retrieved)
            return
        self.notices.unloading(engine, change, self._withdraw)

    async def _adopt(self, change: ModelChanged) -> None:
        """Route a model another front end loaded on every engine."""
        name = change.name
        entry = self._entries.get(name)
        if entry is not None and entry.loading is not None:
            return  # this front end's own load of it answers and routes it
        served = await self.host.served(change.description)  # type: ignore[attr-defined]
        entry = self._entries.get(name)
        if entry is None:
            entry = self._entries[name] = Entry(name, change.source)
        if entry.loading is not None or self.engine.serves(name) or name not in self.notices.told:
            return  # loading here meanwhile, already routed, or unloaded since
        self.engine.add_model(served)
        entry.state, entry.reason, entry.failed_until = ModelState.LOADED, "", 0.0
        entry.memory_bytes = change.memory_bytes
        log.info("model %s loaded by another front end: routed here too", name)

    async def _withdraw(self, name: str) -> None:
        """Out of routing here, and every call here to it answered (another front end is
        unloading it)."""
        draining = self._draining.get(name)
        if draining is None and self.engine.serves(name):
            entry = self._entries.get(name)
            if entry is not None:
                entry.state = ModelState.UNLOADING
            draining = self.engine.remove_model(name)
            try:
                await draining.drained()
            finally:
                if entry is not None and entry.state is ModelState.UNLOADING:
                    entry.state, entry.memory_bytes = ModelState.AVAILABLE, 0
                    if not (entry.on_demand or entry.pinned):
                        self._entries.pop(name, None)
            log.info("model %s unloaded by another front end: out of routing here", name)
        elif draining is not None:
            await draining.drained()


def in_process(config: ServerConfig, engine: Engine) -> ModelManager:
    """On-demand loading from --model-repository for a job with no server around its
    engine (`pooling-server batch`, the Ray stage): weights loaded in this process."""
    return ModelManager(config, engine, LocalHost(config, engine, lambda name, queue: None))


# ------------------------------------------------------------------------ helpers


def _retrieved(task: asyncio.Task[None]) -> None:
    """A load nobody awaited any more (its callers' deadlines passed) fails quietly: its
    outcome is in its entry."""
    if not task.cancelled():
        task.exception()


def check_name(name: str) -> None:
    from pooling_server.engine.requests.shape_rules import MAX_MODEL_NAME_CHARS

    if not name or len(name) > MAX_MODEL_NAME_CHARS:
        raise PoolingError.invalid(
            [
                FieldViolation(
                    "name",
                    f"a model name of 1 to {MAX_MODEL_NAME_CHARS} characters is required",
                    "MODEL_NAME_INVALID",
                )
            ]
        )


def load_failed(entry: Entry, now: float | None = None) -> PoolingError:
    return PoolingError(
        ErrorKind.FAILED_PRECONDITION,
        "MODEL_LOAD_FAILED",
        f'model "{clip(entry.name)}" failed to load: {entry.reason}',
        metadata={"model": clip(entry.name)},
        retry_after_s=max(1.0, entry.retry_after_s(now)),
    )


def not_in_repository(name: str) -> PoolingError:
    return PoolingError(
        ErrorKind.NOT_FOUND,
        "MODEL_NOT_FOUND",
        f'model "{clip(name)}" is not in the repository; give its source to load it',
        (
            FieldViolation(
                "source", "required for a model not in the repository", "MODEL_NOT_FOUND"
            ),
        ),
    )


def load_spec(name: str, source: str, options: Mapping[str, str]) -> tuple[ModelSpec, str | None]:
    """A Load call's model, parsed by the command line's own parser as `--model
    NAME=SOURCE` with its per-model flags: (its spec, its --dtype or None)."""
    from pooling_server.service import cli

    argv = ["--model", f"{name}={source}"]
    for key, value in options.items():
        flag = key.removeprefix("--").replace("_", "-")
        if flag not in LOAD_OPTIONS:
            allowed = ", ".join(sorted(LOAD_OPTIONS))
            raise _bad_option(key, f"not a per-model option; one of {allowed}")
        if flag == "trust-remote-code":
            if str(value).strip().lower() in cli.TRUE_WORDS:
                argv.append("--trust-remote-code")
            continue
        argv += [f"--{flag}", str(value)]
    parser = cli.build_parser()

    def refuse(message: str) -> None:
        raise _bad_option("options", message)

    parser.error = refuse  # type: ignore[method-assign,assignment]
    try:
        args = parser.parse_args(argv)
        specs = cli.model_specs(args)
    except SystemExit as exc:
        raise _bad_option("options", str(exc)) from None
    dtype = args.dtype if any(k.removeprefix("--") == "dtype" for k in options) else None
    return specs[0], dtype


def _bad_option(field_name: str, problem: str) -> PoolingError:
    path = field_name if field_name == "options" else f"options[{clip(field_name, 64)}]"
    return PoolingError.invalid([FieldViolation(path, clip(problem, 300), "LOAD_OPTION_INVALID")])


def read_repository(path: str) -> dict[str, tuple[str, dict[str, str]]]:
    """--model-repository: name -> (source, per-model options). A folder: each folder in
    it is a model, served by its folder's name. A file (JSON or YAML): a mapping of names
    to a source, or to `{source, options}`; a relative source is taken from the file's
    folder."""
    where = Path(path).expanduser()
    if where.is_dir():
        return {
            child.name: (str(child.resolve()), {})
            for child in sorted(where.iterdir())
            if child.is_dir() and not child.name.startswith(".")
        }
    text = where.read_text()
    if where.suffix in (".yaml", ".yml"):
        import yaml

        data: Any = yaml.safe_load(text)
    else:
        data = json.loads(text)
    if not isinstance(data, dict):
        raise ValueError("a repository file maps model names to sources")
    found: dict[str, tuple[str, dict[str, str]]] = {}
    for name, value in data.items():
        options: dict[str, str] = {}
        if isinstance(value, dict):
            source = value.get("source", "")
            options = {str(k): str(v) for k, v in (value.get("options") or {}).items()}
        else:
            source = value
        if not isinstance(source, str) or not source:
            raise ValueError(f"model {name!r} names no source")
        local = where.parent / source
        found[str(name)] = (str(local.resolve()) if local.exists() else source, options)
    return found
