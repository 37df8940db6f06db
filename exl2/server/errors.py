"""Errors in the OpenAI shape `{"error": {"message", "type", "param", "code"}}`, which the openai client parses."""
from __future__ import annotations

from typing import Any, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from exl2.errors import ConfigError, ContextLengthError, Exl2Error


class APIError(Exception):
    """An error answered to the client as is: status code plus the OpenAI error object."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: Optional[str] = None,
                 code: Optional[str] = None, headers: Optional[dict[str, str]] = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def unsupported(param: str, what: str) -> APIError:
    return APIError(400, f"{what} is not supported by this server.", param=param, code="unsupported_parameter")


def from_engine(e: Exception, param: Optional[str]) -> APIError:
    """Map an engine exception: the caller's mistakes are 400s, anything else a 500 without internals."""
    if isinstance(e, ContextLengthError):
        return APIError(400, str(e), param=param, code="context_length_exceeded")
    if isinstance(e, ConfigError):                 # e.g. the chat template rejects the message order
        return APIError(400, str(e), param=param)
    if isinstance(e, Exl2Error):
        return APIError(500, str(e), type="server_error")
    return APIError(500, "The server failed to generate a reply; see its log.", type="server_error")


_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none"}


def _param(loc: tuple) -> Optional[str]:
    """('body', 'messages', 0, 'role') -> 'messages[0].role'. Pydantic adds a union's alternative to the loc
    ('stop', 'list[str]'); the field itself is what the client should hear about, so such tags end the path."""
    out = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(part, str) and (part in _TYPE_TAGS or part[:1].isupper() or "[" in part or "-" in part):
            break
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or None


def first_problem(e: ValidationError) -> tuple[Optional[str], str]:
    """(the top-level field, one clause) of a pydantic ValidationError's first error, for a one-sentence 400 or
    configuration error about settings built from a request."""
    err = e.errors(include_url=False)[0]
    return (str(err["loc"][0]) if err["loc"] else None), err["msg"].removeprefix("Value error, ")


def validated(model, data: Any):
    """`model.model_validate(data)`, or a 400 naming the first field it refuses (request bodies built or read by
    hand: the Responses and Anthropic endpoints)."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        param, problem = first_problem(e)
        raise APIError(400, f"{param or 'The request'}: {problem}.", param=param) from None


def _validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    if not errors:
        return APIError(400, "The request is invalid.")
    err = errors[0]
    if err.get("type") == "json_invalid":
        return APIError(400, f"The request body is not valid JSON ({err.get('ctx', {}).get('error', 'parse error')}).")
    param = _param(tuple(err.get("loc", ())))
    if param is None:
        return APIError(400, "The request body must be a JSON object with the request's fields.")
    msg = err.get("msg", "invalid value")
    return APIError(400, f"Invalid value for '{param}': {msg}.", param=param)


def install_handlers(app: FastAPI) -> None:
    """Every error the app can raise, FastAPI's own 404/405/422 included, leaves in the OpenAI shape."""

    @app.exception_handler(APIError)
    async def _api(request: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        return _validation_error(exc).response()

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception):
        return from_engine(exc, None).response()            # logged by the server; the client gets no internals

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        message = exc.detail if isinstance(exc.detail, str) else "HTTP error"
        if exc.status_code == 404:
            message = f"No route {request.method} {request.url.path} on this server."
        return APIError(exc.status_code, message, type=kind, headers=getattr(exc, "headers", None)).response()
