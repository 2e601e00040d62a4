"""PoolingClient: a blocking client whose methods mirror vLLM's ``LLM`` pooling API.

``client.embed(texts)`` returns what ``LLM.embed(texts)`` would, but runs on a remote pooling
server, so scripts written against vLLM port over by swapping the object they call.

Generated from async_client.py by scripts/unasync_client.py: edit that file, then run
`make clients`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any

import grpc

from pooling_client import _chunking, _encodings, _images, _requests
from pooling_client import _io_sync as _io
from pooling_client._channel import (
    ClientConfig,
    MetadataArg,
    channel_credentials,
    channel_options,
    channel_target,
)
from pooling_client._images import Input
from pooling_client._progress import Progress, UseTqdm, progress
from pooling_client.outputs import (
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    ModelInfo,
    PoolingRequestOutput,
    PoolingResults,
    RepositoryModel,
    RerankRequestOutput,
    ScoringRequestOutput,
    SparseEmbeddingRequestOutput,
    TextOutputsRequestOutput,
    TokenizeOutput,
    model_infos,
    repository_models,
    rerank_request_output,
    tokenize_outputs,
)
from pooling_client.params import LateChunking, PoolingParams
from pooling_client.v1 import pooling_pb2, pooling_pb2_grpc

if TYPE_CHECKING:
    import numpy as np


class PoolingClient:
    """Blocking client for a pooling server.

    Args:
        target: "host:port" of the server, a DNS name resolving to every replica, or a
            list of "ip:port" replicas; calls are spread round-robin and retried on
            UNAVAILABLE or CANCELLED (a replica that stopped or died).
        model: default served model name; None uses the server's default model.
        timeout: default deadline in seconds for each call; None waits indefinitely.
        credentials: TLS channel credentials; or give the PEM parts below instead.
        root_certificates, private_key, certificate_chain: PEM bytes for TLS (mutual TLS
            with key and chain). Without any TLS argument the channel is insecure.
        api_key: sent as "authorization: Bearer <key>" metadata on every call.
        admin_key: sent in its place on the model repository's calls (load_model,
            unload_model), which a server serves only with --admin-key.
        metadata: extra metadata pairs, or a callable returning them, evaluated per call.
        options: gRPC channel options.
        compression: channel compression.
        batch_size: the most inputs (texts, or pairs for score) per request; None uses the
            server's limit. A bigger job is split into chunks of min(batch_size, the server's
            max_client_batch_size) sent over one PoolStream, a bounded number unanswered at
            once, and reassembled in input order, so any number of inputs is one call. Jobs
            that fit in one chunk are one unary Pool call. The server's limits come from one
            ListModels call, made the first time a job might need chunking and then cached.

    Every failed call raises :class:`~pooling_client.errors.PoolingError`.
    """

    def __init__(
        self,
        target: str | Sequence[str],
        *,
        model: str | None = None,
        timeout: float | None = None,
        credentials: grpc.ChannelCredentials | None = None,
        root_certificates: bytes | None = None,
        private_key: bytes | None = None,
        certificate_chain: bytes | None = None,
        api_key: str | None = None,
        admin_key: str | None = None,
        metadata: MetadataArg = None,
        options: Sequence[tuple[str, Any]] | None = None,
        compression: grpc.Compression | None = None,
        batch_size: int | None = None,
    ) -> None:
        creds = channel_credentials(credentials, root_certificates, private_key, certificate_chain)
        merged = channel_options(options)
        self._channel = _io.open_channel(channel_target(target), creds, merged, compression)
        self._stub = pooling_pb2_grpc.PoolingServiceStub(self._channel)
        self._repository = pooling_pb2_grpc.ModelRepositoryServiceStub(self._channel)
        self._config = ClientConfig(model, timeout, metadata, api_key)
        self._admin = ClientConfig(model, timeout, metadata, admin_key)
        self._batch_size = _chunking.check_batch_size(batch_size)
        self._limits: _chunking.StreamLimits | None = None

    def embed(
        self,
        prompts: Input | Sequence[Input],
        *,
        pooling_params: PoolingParams | None = None,
        truncate_prompt_tokens: int | None = None,
        model: str | None = None,
        timeout: float | None = None,
        request_id: str | None = None,
        use_tqdm: UseTqdm = False,
        encoding: str | None = None,
        output: str = "list",
        prompt_name: str | None = None,
        prompt: str | None = None,
        late_chunking: LateChunking | None = None,
    ) -> PoolingResults[EmbeddingRequestOutput] | np.ndarray:
        """One embedding per text, in input order (vLLM ``LLM.embed``).

        ``use_tqdm=True`` shows a tqdm progress bar counting inputs (when tqdm is installed).
        ``encoding`` packs the vectors on the wire: "float32", "float16", "bfloat16",
        "binary", "ubinary", "int8" or "uint8" (the last two on a model with calibration
        ranges: shipped or computed at load, see ModelInfo); None sends repeated floats.
        ``output="numpy"`` returns one (N, D) array instead of the list (numpy needed), as
        sentence-transformers' ``convert_to_numpy``; the list carries ``usage`` and the
        server's ``timing``.
        ``prompt_name`` (one of the model's prompts, see ListModels) or ``prompt`` (a
        text) is prepended to every text, as sentence-transformers' ``encode`` does; with
        neither the model's default prompt applies, and ``prompt=""`` sends none.
        On an image-text model (CLIP, SigLIP) any input may be an image: bytes, a
        ``pathlib.Path`` to a file, or a PIL image (a str is always a text); on an
        audio-text model (CLAP) an audio clip: a WAV, FLAC or OGG file's bytes or path.
        ``late_chunking`` (a :class:`LateChunking`: spans of the one text, or a rule) gives
        each text's chunks instead, as a ``ChunkedEmbeddingOutput`` of spans and vectors
        (computed on the server from one pass over the whole text); not with numpy output.
        """
        texts = _images.as_inputs(prompts)
        _encodings.check_output(output)
        if late_chunking is not None and output == "numpy":
            raise ValueError("late_chunking gives chunks per text: use output='list'")
        results = self._pool(
            "embed",
            texts,
            _requests.CallArgs(
                pooling_params, truncate_prompt_tokens, model, timeout, request_id, use_tqdm
            ),
            encoding=encoding,
            prompt_name=prompt_name,
            prompt=prompt,
            late_chunking=late_chunking,
        )
        return results.numpy() if output == "numpy" else results

    def classify(
        self,
        prompts: Input | Sequence[Input],
        *,
        pooling_params: PoolingParams | None = None,
        truncate_prompt_tokens: int | None = None,
        model: str | None = None,
        timeout: float | None = None,
        request_id: str | None = None,
        use_tqdm: UseTqdm = False,
        candidate_labels: Sequence[str] | None = None,
        label_template: str | None = None,
    ) -> list[ClassificationRequestOutput]:
        """One classification per text, in input order (vLLM ``LLM.classify``).

        On an image-text model (CLIP, SigLIP), inputs may be images (as for :meth:`embed`)
        and the classes are ``candidate_labels`` (zero-shot), each put in
        ``label_template`` ("{label}" replaced; None: the server's "a photo of a {label}.");
        on an audio-text model (CLAP) inputs may be audio clips, zero-shot alike (the
        server's template: "This is a sound of {label}.").
        """
        texts = _images.as_inputs(prompts)
        options: dict[str, Any] = {}
        if candidate_labels is not None:
            options["candidate_labels"] = _requests.as_texts(candidate_labels, "candidate_labels")
        if label_template is not None:
            options["label_template"] = label_template
        return self._pool(
            "classify",
            texts,
            _requests.CallArgs(
                pooling_params, truncate_prompt_tokens, model, timeout, request_id, use_tqdm
            ),
            input_options=options,
        )

    def score(
        self,
        data_1: str | Iterable[Any],
        data_2: Input | Sequence[Input] | None = None,
        *,
        pooling_params: PoolingParams | None = None,
        truncate_prompt_tokens: int | None = None,
        model: str | None = None,
        timeout: float | None = None,
        request_id: str | None = None,
        use_tqdm: UseTqdm = False,
        instruction: str | None = None,
    ) -> list[ScoringRequestOutput]:
        """One relevance score per pair (vLLM ``LLM.score``); on an image-text model
        either side may hold images (as for :meth:`embed`), scored by cosine.

        With ``data_2``: 1:1, 1:N or N:N texts. Without it: ``data_1`` is a list of
        (text_1, text_2) tuples or "query [SEP] document" strings, scored pairwise.
        ``instruction``: an LLM reranker's (its score template's {instruction}; None: the
        template's default), sent as the request's prompt; other models refuse it.
        """
        pairs = _requests.score_texts(data_1, data_2)
        return self._pool(
            "score",
            pairs,
            _requests.CallArgs(
                pooling_params, truncate_prompt_tokens, model, timeout, request_id, use_tqdm
            ),
            prompt=instruction,
        )

    def encode(
        self,
        prompts: str | Sequence[str],
        *,
        pooling_task: str = "token_embed",
        pooling_params: PoolingParams | None = None,
        truncate_prompt_tokens: int | None = None,
        model: str | None = None,
        timeout: float | None = None,
        request_id: str | None = None,
        use_tqdm: UseTqdm = False,
        encoding: str | None = None,
        output: str = "list",
        prompt_name: str | None = None,
        prompt: str | None = None,
    ) -> (
        PoolingResults[PoolingRequestOutput]
        | PoolingResults[EmbeddingRequestOutput]
        | PoolingResults[ClassificationRequestOutput]
        | np.ndarray
        | list[np.ndarray]
    ):
        """Per-token outputs for "token_embed"/"token_classify" (vLLM ``LLM.encode``).

        "embed" and "classify" are forwarded to :meth:`embed` and :meth:`classify`.
        ``encoding`` (token_embed and embed) and ``output`` are as for :meth:`embed`; with
        ``output="numpy"`` token outputs come back as a list of (tokens, D) arrays.
        ``prompt_name`` / ``prompt`` are as for :meth:`embed` (embed and token_embed only).
        """
        _requests.check_encode_task(pooling_task)
        _encodings.check_encoding(encoding, pooling_task)
        _encodings.check_output(output)
        call = _requests.CallArgs(
            pooling_params, truncate_prompt_tokens, model, timeout, request_id, use_tqdm
        )
        kwargs = call._asdict()
        prompting = {"prompt_name": prompt_name, "prompt": prompt}
        if pooling_task == "embed":
            return self.embed(prompts, encoding=encoding, output=output, **prompting, **kwargs)
        if pooling_task == "token_classify" and (prompt_name is not None or prompt is not None):
            raise ValueError("prompts apply to embed and token_embed, not token_classify")
        if pooling_task == "classify":
            if prompt_name is not None or prompt is not None:
                raise ValueError("prompts apply to embed and token_embed, not classify")
            results = self.classify(prompts, **kwargs)
            return results.numpy() if output == "numpy" else results
        texts = _requests.as_texts(prompts)
        results = self._pool(
            pooling_task,
            texts,
            call,
            encoding=encoding,
            **prompting,
        )
        return results.numpy() if output == "numpy" else results

    def embed_sparse(
        self,
        prompts: str | Sequence[str],
        *,
        top_k: int | None = None,
        return_tokens: bool = False,
        pooling_params: PoolingParams | None = None,
        truncate_prompt_tokens: int | None = None,
        model: str | None = None,
        timeout: float | None = None,
        request_id: str | None = None,
        use_tqdm: UseTqdm = False,
        prompt_name: str | None = None,
        prompt: str | None = None,
    ) -> PoolingResults[SparseEmbeddingRequestOutput]:
        """One sparse (SPLADE) embedding per text, in input order, on a model serving
        embed_sparse (sentence-transformers' ``SparseEncoder.encode``).

        Each output holds the vocabulary ``indices`` with a non-zero weight, by decreasing
        weight, and their ``values``; ``top_k`` keeps only the k largest (None or 0: all, as
        ``max_active_dims``); ``return_tokens`` adds each index's token string.
        ``pooling_params.use_activation=False`` skips SPLADE's log saturation.
        ``prompt_name`` / ``prompt`` are as for :meth:`embed`.
        """
        texts = _requests.as_texts(prompts)
        options = _requests.sparse_options(top_k, return_tokens)
        return self._pool(
            "embed_sparse",
            texts,
            _requests.CallArgs(
                pooling_params, truncate_prompt_tokens, model, timeout, request_id, use_tqdm
            ),
            input_options=options,
            prompt_name=prompt_name,
            prompt=prompt,
        )

    def embed_outputs(
        self,
        prompts: str | Sequence[str],
        *,
        dense: bool = True,
        sparse: bool = True,
        multi: bool = True,
        sparse_top_k: int | None = None,
        return_tokens: bool = False,
        encoding: str | None = None,
        pooling_params: PoolingParams | None = None,
        truncate_prompt_tokens: int | None = None,
        model: str | None = None,
        timeout: float | None = None,
        request_id: str | None = None,
        use_tqdm: UseTqdm = False,
    ) -> PoolingResults[TextOutputsRequestOutput]:
        """A multi-output (bge-m3) model's outputs per text, from one forward pass on the
        server: ``dense`` (the normalised CLS vector, a list), ``sparse`` (the lexical
        weights, as :meth:`embed_sparse` gives them; ``sparse_top_k`` and ``return_tokens``
        as its ``top_k`` and ``return_tokens``) and ``multi`` (the ColBERT matrix, numpy
        (rows, dim) when installed). Outputs not asked for are None. ``encoding``
        ("float16", "bfloat16", ...) packs the dense vector and the matrix on the wire;
        ``pooling_params.use_activation=False`` leaves the dense vector unnormalised.
        """
        texts = _requests.as_texts(prompts)
        options = _requests.outputs_options(dense, sparse, multi, sparse_top_k, return_tokens)
        return self._pool(
            "embed_outputs",
            texts,
            _requests.CallArgs(
                pooling_params, truncate_prompt_tokens, model, timeout, request_id, use_tqdm
            ),
            encoding=encoding,
            input_options=options,
        )

    def rerank(
        self,
        query: str,
        documents: Input | Sequence[Input],
        *,
        top_n: int | None = None,
        return_documents: bool = False,
        pooling_params: PoolingParams | None = None,
        truncate_prompt_tokens: int | None = None,
        model: str | None = None,
        timeout: float | None = None,
        request_id: str | None = None,
        instruction: str | None = None,
    ) -> RerankRequestOutput:
        """The documents ranked by relevance to ``query``, most relevant first (on an
        image-text model the documents may be images, as for :meth:`embed`).

        A cross-encoder scores each (query, document) pair; an embedding model ranks by
        cosine similarity, as :meth:`score` does; a ColBERT model by MaxSim; an LLM
        reranker by its template's yes/no logits, with ``instruction`` as the template's
        {instruction} (None: its default; other models refuse one). ``top_n`` keeps the
        best few (None or 0: every document); ``return_documents`` adds each document's
        text to its result. One Rerank call: at most the server's max_client_batch_size
        documents.
        """
        request = _requests.rerank_request(
            query,
            documents,
            top_n=top_n,
            return_documents=return_documents,
            pooling_params=pooling_params,
            truncate_prompt_tokens=truncate_prompt_tokens,
            model=self._config.model_for(model),
            request_id=request_id,
            instruction=instruction,
        )
        response = self._call(self._stub.Rerank, request, timeout)
        count = len(request.documents) or len(request.items)
        return rerank_request_output(response, count, request.top_n)

    def models(self, *, timeout: float | None = None) -> list[ModelInfo]:
        """Every served model and what it can do, the default model first."""
        response = self._call(self._stub.ListModels, pooling_pb2.ListModelsRequest(), timeout)
        self._limits = _chunking.StreamLimits.from_proto(response)
        return model_infos(response)

    def list_models(self, *, timeout: float | None = None) -> list[RepositoryModel]:
        """Every model the server knows, with its state: the served ones ("loaded", each
        with its ``info``), then its repository's others ("available", "loading",
        "failed"). Needs only the API key."""
        response = self._call(self._stub.ListModels, pooling_pb2.ListModelsRequest(), timeout)
        return repository_models(response)

    def load_model(
        self,
        name: str,
        source: str | None = None,
        *,
        options: dict[str, Any] | None = None,
        timeout: float | None = None,
    ) -> RepositoryModel:
        """Load a model at run time (``admin_key``): from ``source`` (a folder or hub id)
        with ``options`` (per-model flags by name: ``{"pooling-type": "mean", "dtype":
        "float32"}``), or from the server's repository by name. Returns once every engine
        has loaded it; a failed load raises MODEL_LOAD_FAILED naming the engines."""
        request = pooling_pb2.LoadRequest(
            name=name,
            source=source or "",
            options={key: _option(value) for key, value in (options or {}).items()},
        )
        response = self._admin_call(self._repository.Load, request, timeout)
        info = ModelInfo.from_proto(response.card) if response.HasField("card") else None
        return RepositoryModel.from_proto(response.model, info)

    def load_adapter(
        self, name: str, path: str, *, model: str | None = None, timeout: float | None = None
    ) -> RepositoryModel:
        """Load a LoRA adapter (``admin_key``): the PEFT folder ``path`` (on the server's
        disk) onto the served ``model`` (None: the default model), served as ``name``;
        requests pick it by ``model=name`` or ``PoolingParams(adapter=name)``. Returns once
        it is routed. Unload it with :meth:`unload_model`."""
        options = {"base-model": model or ""}
        return self.load_model(name, path, options=options, timeout=timeout)

    def unload_model(self, name: str, *, timeout: float | None = None) -> RepositoryModel:
        """Unload a model (``admin_key``): out of routing first, its accepted calls
        finished, then its memory freed."""
        request = pooling_pb2.UnloadRequest(name=name)
        response = self._admin_call(self._repository.Unload, request, timeout)
        return RepositoryModel.from_proto(response.model)

    def tokenize(
        self,
        prompts: str | Sequence[str],
        *,
        model: str | None = None,
        add_special_tokens: bool | None = None,
        timeout: float | None = None,
    ) -> list[TokenizeOutput]:
        """The tokens the model would see for each text (special tokens added by default)."""
        request = _requests.tokenize_request(
            prompts, model=self._config.model_for(model), add_special_tokens=add_special_tokens
        )
        return tokenize_outputs(self._call(self._stub.Tokenize, request, timeout))

    def close(self) -> None:
        """Close the channel; calls in flight are cancelled."""
        self._channel.close()

    def __enter__(self) -> PoolingClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _pool(
        self,
        task: str,
        inputs: _chunking.Inputs,
        call: _requests.CallArgs,
        *,
        encoding: str | None = None,
        input_options: dict[str, Any] | None = None,
        prompt_name: str | None = None,
        prompt: str | None = None,
        late_chunking: LateChunking | None = None,
    ) -> PoolingResults[Any]:
        """Run one task: one unary Pool call, or chunks over PoolStream if it needs several."""
        pooling_params, truncate_prompt_tokens, model, timeout, request_id, use_tqdm = call
        template = _requests.pool_request(
            task,
            _chunking.empty_inputs(task),
            pooling_params=pooling_params,
            truncate_prompt_tokens=truncate_prompt_tokens,
            model=self._config.model_for(model),
            request_id=request_id,
            encoding=encoding,
            input_options=input_options,
            prompt_name=prompt_name,
            prompt=prompt,
            late_chunking=late_chunking,
        )
        count = _chunking.input_count(task, inputs)
        if count is not None and _chunking.needs_limits(count, self._batch_size):
            limits = self._stream_limits(timeout)
            job = _chunking.plan(task, inputs, template, self._batch_size, limits)
            if job is not None:
                with progress(use_tqdm, job.total, task) as bar:
                    return self._pool_stream(job, timeout, bar)
        request = _chunking.whole_request(template, task, inputs)
        with progress(use_tqdm, _requests.expected_outputs(request), task) as bar:
            response, trailers = self._call_with_trailers(self._stub.Pool, request, timeout)
            outputs = _requests.pool_results(task, request, response, trailers)
            bar.update(len(outputs))
        return outputs

    def _pool_stream(
        self, job: _chunking.ChunkedJob, timeout: float | None, bar: Progress
    ) -> list[Any]:
        """Run a chunked job over one PoolStream, never more than ``job.window`` unanswered."""
        return _io.stream_job(
            self._stub,
            job,
            self._config.timeout_for(timeout),
            self._config.call_metadata(),
            bar,
        )

    def _stream_limits(self, timeout: float | None) -> _chunking.StreamLimits:
        """The server's batch and stream limits, fetched with one ListModels call and cached."""
        if self._limits is None:
            request = pooling_pb2.ListModelsRequest()
            response = self._call(self._stub.ListModels, request, timeout)
            self._limits = _chunking.StreamLimits.from_proto(response)
        return self._limits

    def _call_with_trailers(
        self, method: Any, request: Any, timeout: float | None
    ) -> tuple[Any, Any]:
        """As _call, also returning the call's trailing metadata (the server's timings)."""
        return _io.unary(
            method, request, self._config.timeout_for(timeout), self._config.call_metadata()
        )

    def _admin_call(self, method: Any, request: Any, timeout: float | None) -> Any:
        """A model repository call: the admin key in place of the API key."""
        response, _ = _io.unary(
            method, request, self._admin.timeout_for(timeout), self._admin.call_metadata()
        )
        return response

    def _call(self, method: Any, request: Any, timeout: float | None) -> Any:
        """Invoke a unary method with the client's metadata, mapping failures to PoolingError."""
        response, _ = self._call_with_trailers(method, request, timeout)
        return response


def _option(value: Any) -> str:
    """A per-model flag's value as the command line would take it."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        import json

        return json.dumps(value)
    return str(value)
