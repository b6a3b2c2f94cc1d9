"""OpenAI-compatible HTTP API (FastAPI) in front of AsyncLLM.

Routes: `GET /v1/models`, `GET /v1/models/{id}`, `POST /v1/chat/completions`, `POST /v1/completions`,
and `GET /health` (no auth). `server.py` mounts the Gradio UI on the app that `build_api` returns.

Choices (documented, deliberate):
- **Auth.** API keys per user (`access.py`). The request body's `user` field is accepted and
  ignored: it never chooses the cache namespace.
- **Model name.** Several models may be served, each by its own engine (`ServedModels`): a request's
  `model` picks one by the exact id `/v1/models` lists, and a name that is none of them is a 404
  naming the served ids (it is only looked up, never loaded). No `model` (or "") is the default, the
  first. A server of one model takes any `model` string for it (clients insist on sending one).
  Responses name the model actually served.
- **Strict where silence would lie.** Knobs we cannot honour (suffix, best_of != n, vLLM's
  structural tags) are rejected with 400 and a message naming them; fields we do not know are
  ignored (like vLLM). Served: logprobs / top_logprobs (chat), logprobs and echo (completions),
  presence / frequency penalties, logit_bias, response_format (json_object, json_schema), up to
  MAX_PROMPTS prompts per completions request, tools (`tools.py`; on a model whose template cannot
  render tools, a request that does not demand a call is answered without them and says so in
  `X-Chatengine-Tools: ignored`). vLLM extensions accepted: `top_k`, `ignore_eos`,
  `stop_token_ids`, `repetition_penalty`, `min_tokens`, `structured_outputs` and `guided_*`,
  `stream_options.continuous_usage_stats`.
- **max_tokens.** `max_completion_tokens` wins over `max_tokens`. Without either, a chat completion
  may run to the end of the context, capped by the engine's `max_tokens_limit`, the KV pool, and
  `default_max_tokens` when given; a text completion stops at 16 tokens (OpenAI, vLLM, SGLang). An
  explicit max_tokens that does not fit after the prompt is a 400 naming both numbers.
- **cached_tokens** is always reported in `usage.prompt_tokens_details`. It only ever counts the
  caller's own cached blocks and the public persona prompts (the engine salts everything else by
  user), so it reveals nothing about other users.

Errors use OpenAI's shape `{"error": {"message", "type", "param", "code"}}`: 400 bad JSON / types /
ranges / roles / Unicode / prompt too long; 401 bad or missing key; 404 unknown route or model id;
405 known route, wrong method; 413 body too large; 429 rate limit (with Retry-After); 503 engine
stopped or request aborted by the server; 500 only for a real engine failure (the forward pass
raised). Request parsing is in `protocol.py`; relaying the engine's outputs (and disconnects) in
`stream.py`.
"""

import logging
import time
import uuid

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from chatengine import AsyncLLM
from chatengine.app.api.access import Access
from chatengine.app.api.cors import APICORSMiddleware, check_origins
from chatengine.app.api.logprobs import TokenTexts
from chatengine.app.api.protocol import (
    APIError,
    CompletionRequest,
    Kind,
    Limits,
    error_body,
    parse_request,
    read_json_body,
    sampling_params,
)
from chatengine.app.api.stream import (
    ClientDisconnected,
    Job,
    completion_body,
    final_output,
    sse_events,
)
from chatengine.app.api.tools import plan as plan_tools
from chatengine.app.api.tools import template_args
from chatengine.app.models import ServedModels, UnknownModel
from chatengine.app.users import UserDirectory

log = logging.getLogger("chatengine.api")

KNOWN_ROUTES = {"/v1/models": "GET", "/v1/chat/completions": "POST", "/v1/completions": "POST"}
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class OpenAIService:
    """The routes' view of one served model: its engine, name and limits, and who may call (shared)."""

    def __init__(
        self, engine: AsyncLLM, access: Access, *, model_name: str, max_body_bytes: int, default_max_tokens: int | None
    ):
        self.engine, self.access, self.model_name = engine, access, model_name
        self.max_body_bytes = max_body_bytes
        self.limits = Limits.of(engine, default_max_tokens)
        self.created = int(time.time())
        self._texts: TokenTexts | None = None  # token strings and bytes for logprobs, made on first use

    def check_running(self) -> None:
        if not self.engine.is_running:
            raise APIError(503, "the engine has stopped", type="server_error")

    def model_card(self) -> dict:
        return {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "chatengine",
            "max_model_len": self.limits.max_model_len,
        }

    def prepare(self, kind: Kind, body: dict, user: str | None) -> tuple[CompletionRequest, list[Job]]:
        """Validate, tokenize and check with the engine (run in a worker thread: long prompts must not
        block other streams). One Job per prompt; each prompt past the first counts as one more
        request for the rate limit, taken before anything is tokenized."""
        req = parse_request(kind, body, self.limits)
        prompts = req.prompts if req.prompts is not None else [None]
        if len(prompts) > 1:
            self.access.rate_limit(user, cost=len(prompts) - 1, why=f"this request holds {len(prompts)} prompts")
        request_id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        s = req.sampling
        texts = self.token_texts() if s.logprobs is not None else None
        tools = plan_tools(self.engine, req.tools) if kind == "chat" else None
        jobs = []
        for k, prompt in enumerate(prompts):
            ids = self.tokenize(req, prompt)
            params = sampling_params(s, len(ids), self.limits)
            self.check(kind, ids, params, user, s.structured_param)
            echo = None
            if s.echo:
                echo = prompt if isinstance(prompt, str) else self.engine.get_tokenizer().decode(ids)
            engine_id = f"{request_id}-{k}" if len(prompts) > 1 else None
            jobs.append(
                Job(
                    kind,
                    request_id,
                    ids,
                    params,
                    user,
                    self.model_name,
                    logprobs=s.logprobs,
                    texts=texts,
                    echo=echo,
                    generate=s.max_tokens != 0,
                    prompt_index=k,
                    engine_id=engine_id,
                    tools=tools,
                )
            )
        return req, jobs

    def token_texts(self) -> TokenTexts:
        if self._texts is None:
            self._texts = TokenTexts(self.engine.get_tokenizer())
        return self._texts

    def check(self, kind: Kind, ids: list[int], params, user: str | None, structured_param: str | None) -> None:
        """The engine's own checks (context length, KV pool, vocabulary, a structured output's schema,
        regex or grammar), without adding anything: a 400 naming the field."""
        try:
            self.engine.check_request(ids, params, user=user)
        except ValueError as e:
            message = str(e)
            fields = ("max_tokens", "min_tokens", "stop_token_ids", "logit_bias", "logprobs", "seed")
            param = next((f for f in fields if f in message), None)
            if param is None and structured_param is not None and "prompt" not in message:
                param = structured_param  # xgrammar's words for a bad schema, regex or grammar
            elif param is None and "prompt" in message:
                param = "messages" if kind == "chat" else "prompt"
            code = "context_length_exceeded" if "context" in message else None
            raise APIError(400, message, param=param, code=code) from None

    def tokenize(self, req: CompletionRequest, prompt: str | list[int] | None = None) -> list[int]:
        if req.messages is not None:
            try:
                messages, tools = template_args(self.engine, [m.model_dump() for m in req.messages], req.tools)
                return self.engine.apply_chat_template(messages, tools=tools)
            except ValueError as e:
                raise APIError(400, str(e), param="messages") from None
            except Exception as e:  # noqa: BLE001 - e.g. jinja2 TemplateError: "roles must alternate user/assistant"
                raise APIError(
                    400, f"the model's chat template rejected these messages: {e}", param="messages"
                ) from None
        prompt = prompt if prompt is not None else req.prompt
        if isinstance(prompt, str):
            try:
                return self.engine.encode(prompt)
            except ValueError as e:
                raise APIError(400, str(e), param="prompt") from None
        return list(prompt or ())

    async def complete(self, kind: Kind, request: Request, user: str | None, body: dict) -> Response:
        """One chat or text completion on this model, whole or streamed (the caller is authenticated)."""
        req, jobs = await run_in_threadpool(self.prepare, kind, body, user)
        self.check_running()
        headers = jobs[0].tools.headers if jobs[0].tools is not None else {}  # X-Chatengine-Tools: ignored
        if req.stream.stream:
            events = sse_events(self.engine, request, jobs, req.stream.include_usage, req.stream.continuous_usage)
            return StreamingResponse(events, media_type="text/event-stream", headers={**SSE_HEADERS, **headers})
        try:
            outs = await final_output(self.engine, request, jobs)
        except ClientDisconnected:
            return Response(status_code=499)
        return JSONResponse(completion_body(jobs, outs), headers=headers)


# ---- routes -------------------------------------------------------------------------------------
router = APIRouter()


def _service(request: Request) -> OpenAIService:
    """The default model's service (its access is every model's)."""
    return request.app.state.api


def _services(request: Request) -> ServedModels:
    return request.app.state.apis


def _model_service(request: Request, model_id) -> OpenAIService:
    """The service of a request's ``model``: exactly a served id (404 naming them otherwise); none: the
    default; with one model served, any name is it."""
    services = _services(request)
    if model_id is not None and not isinstance(model_id, str):
        raise APIError(400, f"'model' must be a string, got {type(model_id).__name__}", param="model")
    if len(services) == 1:
        return services.default
    try:
        return services.engine(model_id)
    except UnknownModel as e:
        raise APIError(404, str(e), param="model", code="model_not_found") from None


@router.get("/health")
async def health(request: Request):
    stopped = [mid for mid, s in _services(request).items() if not s.engine.is_running]
    if stopped:
        message = "the engine has stopped" if len(_services(request)) == 1 else f"the engine of {stopped[0]} stopped"
        return JSONResponse({"status": "error", "message": message}, status_code=503)
    return {"status": "ok"}


@router.get("/v1/models")
async def list_models(request: Request):
    _service(request).access.authenticate(request)
    return {"object": "list", "data": [s.model_card() for _, s in _services(request).items()]}


@router.get("/v1/models/{model_id:path}")
async def get_model(model_id: str, request: Request):
    _service(request).access.authenticate(request)
    services = _services(request)
    if model_id not in services:
        raise APIError(
            404,
            f"the model {model_id!r} does not exist; this server serves {', '.join(map(repr, services.ids))}",
            param="model",
            code="model_not_found",
        )
    return services[model_id].model_card()


async def _complete(kind: Kind, request: Request) -> Response:
    """Authenticate, rate-limit and read the body once, then hand it to the model it names."""
    access = _service(request).access
    user = access.authenticate(request)
    access.rate_limit(user)
    body = await read_json_body(request, _service(request).max_body_bytes)
    return await _model_service(request, body.get("model")).complete(kind, request, user, body)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request):
    return await _complete("chat", request)


@router.post("/v1/completions")
async def completions(request: Request):
    return await _complete("completion", request)


# Last: unknown /v1 paths get OpenAI-style errors even when the UI is mounted at "/" (the mount
# would otherwise answer them with its own 404 page).
@router.api_route(
    "/v1/{rest:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"], include_in_schema=False
)
async def unknown_v1(rest: str, request: Request):
    path = "/v1/" + rest
    allowed = KNOWN_ROUTES.get(path.rstrip("/"))
    if allowed is not None:
        return JSONResponse(
            error_body(f"method {request.method} is not allowed on {path}; use {allowed}"),
            status_code=405,
            headers={"Allow": allowed},
        )
    raise APIError(404, f"unknown route {request.method} {path}", code="not_found")


# ---- errors -------------------------------------------------------------------------------------
async def _api_error(request: Request, e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
    if e.status_code == 404:
        message = f"unknown route {request.method} {request.url.path}"
    elif e.status_code == 405:
        message = f"method {request.method} is not allowed on {request.url.path}"
    else:
        message = str(e.detail)
    return JSONResponse(
        error_body(message, code="not_found" if e.status_code == 404 else None),
        status_code=e.status_code,
        headers=e.headers,
    )


async def _internal_error(request: Request, e: Exception) -> JSONResponse:
    log.exception("unhandled error in %s %s", request.method, request.url.path)
    return JSONResponse(error_body("internal server error", "server_error"), status_code=500)


# ---- the app ------------------------------------------------------------------------------------
def build_api(
    engine: AsyncLLM | ServedModels,
    users: dict | UserDirectory | None,
    *,
    model_name: str,
    max_body_bytes: int = 1_000_000,
    rate_limit_per_minute: int | None = None,
    default_max_tokens: int | None = None,
    cors_origins: list[str] | None = None,
) -> FastAPI:
    """The FastAPI app serving the OpenAI-compatible routes for `engine`, or for each engine of a
    ServedModels (each under its own id, the first the default).

    users: a UserDirectory (hashed keys in the database), the dict of `chatengine.app.auth.load_users`,
    or None for local single-user mode (any key).
    model_name: the id of a single engine, listed by /v1/models and named in its responses (a
    ServedModels names its own).
    max_body_bytes: larger request bodies get 413.
    rate_limit_per_minute: completion requests per user per minute (token bucket), None = unlimited.
    default_max_tokens: cap on the completion length when the request names none (None: fill the context).
    cors_origins: origins whose pages may call the API from a browser ("*": any); None: no CORS.
    """
    if not isinstance(model_name, str) or not model_name:
        raise ValueError("model_name must be a non-empty string")
    access = Access(users, rate_limit_per_minute)
    app = FastAPI(
        title="chatengine OpenAI-compatible API",
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
        exception_handlers={APIError: _api_error, StarletteHTTPException: _http_error, Exception: _internal_error},
    )
    models = engine if isinstance(engine, ServedModels) else ServedModels({model_name: engine})
    app.state.apis = ServedModels(
        {
            mid: OpenAIService(
                e, access, model_name=mid, max_body_bytes=max_body_bytes, default_max_tokens=default_max_tokens
            )
            for mid, e in models.items()
        }
    )
    app.state.api = app.state.apis.default
    app.include_router(router)
    if cors_origins:
        app.add_middleware(APICORSMiddleware, origins=check_origins(cors_origins))
    return app
