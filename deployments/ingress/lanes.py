"""Which priority lane a request goes to: the body's ``lane``, the ``X-Embedfleet-Lane`` header,
or the lane its API key is limited to; interactive when none says.

One rule for both APIs, so the same request gets the same lane (or the same error) on
``/v1/embeddings`` and ``/embed``.
"""

from __future__ import annotations

from starlette.requests import Request

from .auth import LANE_LIMIT
from ..common.contracts import LANES, Lane
from ..common.errors import InvalidParameterValue, LaneNotAllowed

LANE_HEADER = "x-embedfleet-lane"


def request_lane(request: Request, body_lane: Lane | None) -> Lane:
    header = request.headers.get(LANE_HEADER)
    from_header = header.strip() if header is not None else None
    if from_header is not None and from_header not in LANES:  # exact, as the body's field
        raise InvalidParameterValue(f"{LANE_HEADER} must be one of {', '.join(LANES)}; got "
                                    f"{header[:40]!r}", param=LANE_HEADER)
    if body_lane is not None and from_header is not None and body_lane != from_header:
        raise InvalidParameterValue(f"the body asks for lane '{body_lane}' and the "
                                    f"{LANE_HEADER} header for '{from_header}': send one",
                                    param="lane")
    limit: Lane | None = getattr(request.state, LANE_LIMIT, None)
    asked = body_lane or from_header  # type: ignore[assignment]
    if limit is not None and asked is not None and asked != limit:
        raise LaneNotAllowed(f"this API key may only use the '{limit}' lane; the request asks "
                             f"for '{asked}'", param="lane")
    return asked or limit or "interactive"  # type: ignore[return-value]
