"""Request bodies: bounded in size while read, bounded in depth while parsed.

A body is read on the event loop (only bytes move there) and parsed off it, since a
multi-megabyte JSON document takes long enough to stall every other request and /health.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.requests import Request

from pjinfer.server.protocol import APIError

DEFAULT_MAX_REQUEST_BYTES = 16 * 2**20
MAX_JSON_DEPTH = 64  # OpenAI bodies nest a handful of levels; 100k levels blow the C stack


def too_large(max_bytes: int) -> APIError:
    return APIError(f"the request body is larger than this server's limit of {max_bytes} bytes "
                    "(--max-request-bytes); send a shorter prompt", status=413,
                    code="request_too_large")


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The raw body, refused (413) as soon as it is known to pass `max_bytes`: from its
    Content-Length before anything is read, else while it streams in."""
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > max_bytes:
        raise too_large(max_bytes)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise too_large(max_bytes)
        chunks.append(chunk)
    return b"".join(chunks)


def parse_json(raw: bytes) -> dict[str, Any]:
    """A JSON object, or a 400 saying what is wrong with the document."""
    too_deep = APIError(f"the request body nests JSON deeper than {MAX_JSON_DEPTH} levels")
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(f"the request body is not valid JSON: {e}") from None
    except RecursionError:  # deeper than the parser's own recursion limit
        raise too_deep from None
    if not isinstance(body, dict):
        raise APIError("the request body must be a JSON object")
    if not _depth_at_most(body, MAX_JSON_DEPTH):
        raise too_deep
    return body


def _depth_at_most(body: dict[str, Any], limit: int) -> bool:
    """Iterative, so checking a deep document cannot itself recurse too deeply."""
    stack: list[tuple[Any, int]] = [(body, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            return False
        children = node.values() if isinstance(node, dict) else node
        stack.extend((c, depth + 1) for c in children if isinstance(c, dict | list))
    return True
