"""API errors and their wire shapes: OpenAI-style everywhere, Anthropic-style on /v1/messages."""

from __future__ import annotations

import json

_OPENAI_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                 408: "timeout_error", 413: "invalid_request_error", 422: "invalid_request_error",
                 429: "rate_limit_error", 503: "service_unavailable_error"}
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                    408: "timeout_error", 413: "request_too_large", 422: "invalid_request_error",
                    429: "rate_limit_error", 503: "overloaded_error", 500: "api_error"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param

    @classmethod
    def from_recipe(cls, err) -> "APIError":
        """deepseek-recipe's ConversionError carries a status code and an error body; keep its message."""
        message = str(err)
        try:
            body = json.loads(err.body)
            inner = body.get("error", body)
            message = inner.get("message", message) if isinstance(inner, dict) else str(inner)
        except (TypeError, ValueError, AttributeError):
            pass
        status = getattr(err, "status_code", 400) or 400
        return cls(status if 400 <= status < 500 else 400, message)

    def body(self, anthropic: bool) -> dict:
        if anthropic:
            return {"type": "error", "error": {"type": _ANTHROPIC_TYPES.get(self.status, "api_error"),
                                               "message": self.message}}
        return {"error": {"message": self.message, "type": _OPENAI_TYPES.get(self.status, "server_error"),
                          "param": self.param, "code": self.status}}


def parse_json_object(raw: bytes) -> dict:
    """A request body as a JSON object, else a 400 naming what is wrong (the server and the router share it)."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(400, f"request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise APIError(400, "request body must be a JSON object")
    return body
