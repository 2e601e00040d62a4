"""ModelRepositoryService over gRPC: Load, Unload and List (service/repository.py).

Served only with --admin-key, and each call checked against the admin keys here, in the
servicer, so that both gRPC doors (grpcio's and Node's) make the same check: an --api-key
opens PoolingService, never this. Without an admin key the service is not registered at
all: loading a folder or hub id named by a caller is code and disk the operator chose to
expose, and a server that exposes it must say so by giving a key.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import grpc

from pooling_server.engine.errors import ErrorKind, PoolingError
from pooling_server.service.errors import to_grpc_status, unavailable
from pooling_server.service.grpc import convert
from pooling_server.service.grpc.handlers import Malformed, tolerant
from pooling_server.service.ops.auth import BearerKeys
from pooling_server.service.proto import pooling_pb2 as pb
from pooling_server.service.repository import Entry, ModelManager, ModelState
from pooling_server.service.runner import RequestRunner

SERVICE = pb.DESCRIPTOR.services_by_name["ModelRepositoryService"]
STATES = {
    ModelState.AVAILABLE: pb.MODEL_STATE_AVAILABLE,
    ModelState.LOADING: pb.MODEL_STATE_LOADING,
    ModelState.LOADED: pb.MODEL_STATE_LOADED,
    ModelState.FAILED: pb.MODEL_STATE_FAILED,
    ModelState.UNLOADING: pb.MODEL_STATE_UNLOADING,
}
ADMIN_REQUIRED = PoolingError(
    ErrorKind.UNAUTHENTICATED,
    "ADMIN_KEY_REQUIRED",
    "the model repository needs `authorization: Bearer ADMIN_KEY` (--admin-key); an API key "
    "does not open it",
)


def repository_model(entry: Entry, manager: ModelManager) -> pb.RepositoryModel:
    return pb.RepositoryModel(
        name=entry.name,
        state=STATES[entry.state],
        source=entry.source,
        memory_bytes=entry.memory_bytes,
        reason=entry.reason,
        load_seconds=entry.load_seconds,
        in_flight=manager.in_flight(entry.name),
        pinned=entry.pinned,
        retry_after_s=entry.retry_after_s(),
        parent=entry.parent,
    )


def add_adapters(response: pb.ListModelsResponse, adapters: Mapping[str, str]) -> None:
    """ListModels: each LoRA adapter (name -> its model) as its model's card under the
    adapter's name, with `parent` set, after the models (as vLLM lists them)."""
    cards = {card.name: card for card in response.models}
    for name, parent in sorted(adapters.items()):
        base = cards.get(parent)
        if base is None:
            continue
        card = response.models.add()
        card.CopyFrom(base)
        card.name, card.parent, card.is_default = name, parent, False


def add_states(response: pb.ListModelsResponse, manager: ModelManager | None) -> None:
    """ListModels: each served model's state and memory, and the repository's others."""
    if manager is None:
        for card in response.models:
            card.state = pb.MODEL_STATE_LOADED
        return
    for card in response.models:
        card.state = pb.MODEL_STATE_LOADED
        entry = manager.entry(card.name)
        card.memory_bytes = entry.memory_bytes if entry is not None else 0
    served = {card.name for card in response.models}
    response.repository.extend(
        repository_model(entry, manager) for entry in manager.entries() if entry.name not in served
    )


class RepositoryServicer:
    def __init__(self, runner: RequestRunner, admin_keys: Sequence[str]) -> None:
        """The manager is the runner's, once the models at start have loaded."""
        self.runner = runner
        self.keys = BearerKeys(admin_keys)

    @property
    def manager(self) -> ModelManager:
        manager = self.runner.repository
        if manager is None:
            raise unavailable("the models are still loading; retry shortly")
        return manager

    async def Load(self, request: pb.LoadRequest, context: Any) -> pb.LoadResponse:
        async def load() -> pb.LoadResponse:
            entry = await self.manager.load(request.name, request.source, dict(request.options))
            card = None
            served = (
                self.manager.engine.model_named(entry.name) if entry.state == "loaded" else None
            )
            if served is not None:
                card = convert.model_card(served.info)
                card.state, card.memory_bytes = pb.MODEL_STATE_LOADED, entry.memory_bytes
            return pb.LoadResponse(model=repository_model(entry, self.manager), card=card)

        return await self._admin(request, context, load)

    async def Unload(self, request: pb.UnloadRequest, context: Any) -> pb.UnloadResponse:
        async def unload() -> pb.UnloadResponse:
            entry = await self.manager.unload(request.name)
            return pb.UnloadResponse(model=repository_model(entry, self.manager))

        return await self._admin(request, context, unload)

    async def List(self, request: pb.ListRequest, context: Any) -> pb.ListResponse:
        async def listing() -> pb.ListResponse:
            entries = self.manager.entries()
            return pb.ListResponse(models=[repository_model(e, self.manager) for e in entries])

        return await self._admin(request, context, listing)

    async def _admin(self, request: Any, context: Any, work: Callable[[], Awaitable[Any]]) -> Any:
        """The admin key checked, the message parsed, then `work`; a refusal as a status."""
        try:
            if not self.keys.allow_metadata(context.invocation_metadata() or ()):
                raise ADMIN_REQUIRED
            if type(request) is Malformed:
                raise request.error()
            return await work()
        except PoolingError as error:
            await context.abort_with_status(to_grpc_status(error))
            raise


def add_repository_service(servicer: RepositoryServicer, server: Any) -> None:
    """Register the service's methods (unary) on a grpc.aio server or the Node door's
    HandlerSet."""
    handlers = {}
    for method in SERVICE.methods:
        handlers[method.name] = grpc.unary_unary_rpc_method_handler(
            getattr(servicer, method.name),
            request_deserializer=tolerant(getattr(pb, method.input_type.name)),
            response_serializer=getattr(pb, method.output_type.name).SerializeToString,
        )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(SERVICE.full_name, handlers),)
    )
    server.add_registered_method_handlers(SERVICE.full_name, handlers)
