"""The model repository over HTTP: Triton's /v2/repository routes (service/repository.py).

Triton's routes rather than vLLM's: the model repository (a folder of model folders,
listed, loaded and unloaded by name) is Triton's idea and its API is shaped by it, where
vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter are for adapters on a base model
and vLLM has no route for loading a model. Operators' tools (tritonclient's
load_model, unload_model and get_model_repository_index) speak these routes:

- POST /v2/repository/index: every model known, `[{name, version, state, reason, ...}]`;
  `{"ready": true}` lists only the loaded ones.
- POST /v2/repository/models/{name}/load: load it, from its repository entry or from
  `{"parameters": {"source": PATH_OR_ID, "<per-model flag>": value, ...}}`.
- POST /v2/repository/models/{name}/unload.

Each answers once done. They are registered only with --admin-key, and each call must
carry the admin key (service/http/app.py checks it in place of the API key).
"""

from __future__ import annotations

from typing import Any

import msgspec
from aiohttp import web

from pooling_server.engine.errors import ErrorKind, PoolingError
from pooling_server.service.errors import unavailable
from pooling_server.service.http import door as http_doors
from pooling_server.service.http.guard import body_parsed
from pooling_server.service.repository import Entry, ModelManager
from pooling_server.service.runner import RequestRunner

PREFIX = "/v2/repository/"
RPCS = {"index": "RepositoryIndex", "load": "RepositoryLoad", "unload": "RepositoryUnload"}
# vLLM's LoRA routes (service/adapters.py), behind the same admin key.
LORA_ROUTES = frozenset({"/v1/load_lora_adapter", "/v1/unload_lora_adapter"})


class IndexBody(msgspec.Struct, forbid_unknown_fields=False):
    ready: bool = False


class LoraBody(msgspec.Struct, forbid_unknown_fields=False):
    """vLLM's load_lora_adapter and unload_lora_adapter bodies; `model`, ours: the served
    model the adapter goes on (unset: the default model), where vLLM serves one."""

    lora_name: str = ""
    lora_path: str = ""
    model: str = ""


class LoadBody(msgspec.Struct, forbid_unknown_fields=False):
    """Triton's load body: every parameter but `source` is a per-model flag."""

    parameters: dict[str, str | int | float | bool] = {}


def model_entry(entry: Entry, manager: ModelManager) -> dict[str, Any]:
    """One model as the index and /v1/models show it."""
    return {
        "name": entry.name,
        "version": "1",
        "state": entry.state.value,
        "reason": entry.reason,
        "source": entry.source,
        "memory_bytes": entry.memory_bytes,
        "load_seconds": round(entry.load_seconds, 3),
        "in_flight": manager.in_flight(entry.name),
        "pinned": entry.pinned,
        "retry_after_s": round(entry.retry_after_s(), 3),
        **({"parent": entry.parent} if entry.parent else {}),
    }


def with_states(data: list[dict[str, Any]], manager: ModelManager | None) -> list[dict[str, Any]]:
    """/v1/models: each served model's state and memory, then the repository's others."""
    for model in data:
        entry = manager.entry(model["id"]) if manager is not None else None
        model["state"] = "loaded"
        model["memory_bytes"] = entry.memory_bytes if entry is not None else 0
    if manager is None:
        return data
    served = {model["id"] for model in data}
    for entry in manager.entries():
        if entry.name not in served:
            listed = model_entry(entry, manager)
            data.append({"id": listed.pop("name"), "object": "model", **listed})
    return data


class RepositoryRoutes:
    def __init__(self, runner: RequestRunner) -> None:
        self.runner = runner

    def routes(self) -> list[web.RouteDef]:
        return [
            web.post(PREFIX + "index", self.index),
            web.post(PREFIX + "models/{name}/load", self.load),
            web.post(PREFIX + "models/{name}/unload", self.unload),
            web.post("/v1/load_lora_adapter", self.load_lora),
            web.post("/v1/unload_lora_adapter", self.unload_lora),
        ]

    @property
    def manager(self) -> ModelManager:
        manager = self.runner.repository
        if manager is None:
            raise unavailable("the models are still loading; retry shortly")
        return manager

    async def index(self, request: web.Request) -> web.Response:
        body = await _body(request, IndexBody)
        manager = self.manager
        entries = manager.entries()
        if body.ready:
            entries = [entry for entry in entries if entry.state == "loaded"]
        return http_doors.json_response([model_entry(entry, manager) for entry in entries])

    async def load(self, request: web.Request) -> web.Response:
        body = await _body(request, LoadBody)
        options = {key: _flag_value(value) for key, value in body.parameters.items()}
        source = options.pop("source", "")
        manager = self.manager
        entry = await manager.load(request.match_info["name"], source, options)
        return http_doors.json_response(model_entry(entry, manager))

    async def unload(self, request: web.Request) -> web.Response:
        await _body(request, IndexBody)  # Triton's unload_dependents and such: ignored
        manager = self.manager
        entry = await manager.unload(request.match_info["name"])
        return http_doors.json_response(model_entry(entry, manager))

    async def load_lora(self, request: web.Request) -> web.Response:
        """vLLM's answer: a line of text once the adapter is routed."""
        body = await _body(request, LoraBody)
        await self.manager.adapters.load(body.lora_name, body.lora_path, body.model)
        return web.Response(text=f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    async def unload_lora(self, request: web.Request) -> web.Response:
        body = await _body(request, LoraBody)
        await self.manager.adapters.unload(body.lora_name)
        text = f"Success: LoRA adapter '{body.lora_name}' removed successfully."
        return web.Response(text=text)


def _flag_value(value: str | int | float | bool) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


async def _body(request: web.Request, kind: type[Any]) -> Any:
    """The body as `kind`; none (Triton's clients often send none) as its defaults."""
    raw = await http_doors.read_raw(request)
    try:
        if not bytes(raw).strip():
            return kind()
        return msgspec.json.decode(raw, type=kind)  # an admin's small body: no counting
    except msgspec.DecodeError as exc:
        raise PoolingError(ErrorKind.INVALID_ARGUMENT, "INVALID_BODY", str(exc)) from None
    finally:
        body_parsed(request)
