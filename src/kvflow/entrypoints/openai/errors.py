"""Errors as OpenAI shapes them: `{"error": {"message", "type", "param", "code"}}`.

Every failure a client can cause becomes a 4xx with a message naming what to fix; anything else
is a 500 whose message says only that the fault is ours (the details go to the server log, never
to the client). The engine keeps serving after either.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvflow.engine.async_llm import EngineDeadError, EngineOverloadedError, RequestFailedError

logger = logging.getLogger("kvflow")

RETRY_AFTER_SECONDS = 1  # what an overloaded server asks a client to wait before retrying


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        kind = "invalid_request_error" if self.status < 500 else "server_error"  # OpenAI's two types
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else {}
        return JSONResponse(self.body(), status_code=self.status, headers={**headers, **self.headers})


def bad_request(error: ValueError) -> APIError:
    """The engine or SamplingParams refused the input; their messages name the field and range."""
    return APIError(400, str(error))


def internal_error() -> APIError:
    return APIError(500, "internal server error; the request was not completed", code="internal_error")


def from_validation(error: ValidationError) -> APIError:
    """The first problem pydantic found in a request body, with its field path as `param`."""
    first = error.errors()[0]
    path = [str(p) for p in first.get("loc", ()) if not _is_union_branch(p)]
    message = first.get("msg", "invalid request").removeprefix("Value error, ")
    if first.get("type") == "json_invalid":
        return APIError(400, f"the body is not valid JSON (UTF-8): {message.removeprefix('Invalid JSON: ')}")
    param = ".".join(path) or None
    return APIError(400, f"{param or 'request body'}: {message}", param=param)


def _is_union_branch(part: object) -> bool:
    # pydantic names the branch of a union it tried ("str", "list[str]") inside the location.
    return isinstance(part, str) and (part in ("str", "int", "float", "bool", "none") or "[" in part)


def from_exception(error: BaseException) -> APIError:
    """What a client is told about an exception raised while serving its request. Its body was
    validated before (`read_body` turns that ValidationError into an APIError), so any other
    ValidationError is a fault of ours, a 500 like the rest."""
    if isinstance(error, APIError):
        return error
    if isinstance(error, EngineOverloadedError):
        return APIError(503, str(error), code="server_overloaded", headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
    if isinstance(error, EngineDeadError):
        return APIError(503, f"the engine is not running: {error}", code="engine_unavailable")
    if not isinstance(error, RequestFailedError):
        logger.error("internal error while serving a request", exc_info=error)
    return internal_error()


def install_error_handlers(app: FastAPI) -> None:
    """For what happens outside the routes' own `except` (api_server._answer): the API-key check
    (an APIError from a dependency), routing (404, 405), and the last resort."""
    async def api_error(_: Request, exc: Exception) -> JSONResponse:
        return from_exception(exc).response()

    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            return APIError(404, _not_a_route(request), code="not_found").response()
        return APIError(exc.status_code, str(exc.detail)).response()

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(Exception, api_error)  # the last resort: a 500 with no trace


# Routes clients try that this server does not have, and what to say of each.
_NOT_SERVED = {
    "/v1/embeddings": "this server has no embedding model: kvflow serves generative models (chat and completions)",
    "/v1/rerank": "this server has no reranking model: kvflow serves generative models (chat and completions)",
    "/v1/score": "this server has no scoring model: kvflow serves generative models (chat and completions)",
}


def _not_a_route(request: Request) -> str:
    """A 404's message: the route asked for, why it is not here where we know, and what is (the
    app's `state.served_routes`, which api_server.build_app lists)."""
    path = request.url.path.rstrip("/")[:200] or "/"
    served = getattr(request.app.state, "served_routes", ())
    reason = _NOT_SERVED.get(path, "no such route")
    return f"{request.method} {path}: {reason}. This server serves {', '.join(served)}"
