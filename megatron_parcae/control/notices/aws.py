"""AWS EC2 Spot: the interruption notice, read from the instance metadata service.

A spot instance gets no signal when its two-minute warning starts; the warning is only
in the metadata service (IMDSv2, http://169.254.169.254):

- `PUT /latest/api/token` with header `X-aws-ec2-metadata-token-ttl-seconds: 21600`
  answers a session token (text), sent as `X-aws-ec2-metadata-token` on every GET.
  A GET answered 401 means the token expired: fetch a new one and go on.
- `GET /latest/meta-data/spot/instance-action` answers 404 until the instance is marked,
  then `{"action": "terminate"|"stop"|"hibernate", "time": "2026-11-22T16:34:24Z"}`:
  `time` (UTC) is the deadline. AWS suggests polling every 5 seconds.
- `GET /latest/meta-data/events/recommendations/rebalance` answers 404, then
  `{"noticeTime": "2026-11-22T16:30:00Z"}`: a hint that the risk of interruption rose,
  not a notice. It goes to `on_hint` (action "rebalance", once), never to `on_notice`.
"""

from __future__ import annotations

import datetime
import http.client
import logging
import threading
import time
from collections.abc import Callable

from megatron_parcae.control.notices.base import (
    POLL_SECONDS,
    REQUEST_TIMEOUT_S,
    Malformed,
    Notice,
    NoticeWatcher,
    Response,
    Unavailable,
    header_value,
)

log = logging.getLogger(__name__)

ENDPOINT = "http://169.254.169.254"
TOKEN_PATH = "/latest/api/token"
TOKEN_TTL_S = 21600  # the longest AWS allows
INSTANCE_ACTION_PATH = "/latest/meta-data/spot/instance-action"
REBALANCE_PATH = "/latest/meta-data/events/recommendations/rebalance"


def parse_time(value: object, what: str) -> float:
    """An ISO 8601 time with its zone, as AWS writes them, in unix seconds."""
    if not isinstance(value, str):
        raise Malformed(f"{what} is not a string")
    try:
        moment = datetime.datetime.fromisoformat(value)
    except ValueError:
        raise Malformed(f"{what} is not an ISO 8601 time") from None
    if moment.tzinfo is None:
        raise Malformed(f"{what} has no time zone")
    return moment.timestamp()


class AwsWatcher(NoticeWatcher):
    source = "aws"

    def __init__(self, endpoint: str = ENDPOINT, poll_seconds: float = POLL_SECONDS) -> None:
        super().__init__(endpoint, poll_seconds)
        self._token: str | None = None
        self._hinted = False

    def answers(self, timeout: float) -> bool:
        try:
            self._token = self._new_token(timeout)
        except (OSError, http.client.HTTPException, Malformed, Unavailable):
            return False
        return True

    def _wait_for_notice(self, stop: threading.Event, on_hint: Callable[[Notice], None]) -> Notice | None:
        return self._poll(lambda: self._check(on_hint), stop, self.poll_seconds)

    def _check(self, on_hint: Callable[[Notice], None]) -> Notice | None:
        found = self._document(INSTANCE_ACTION_PATH, "instance-action")
        if found is not None:
            document, received_at = found
            action = document.get("action")
            if not isinstance(action, str) or not (action.isascii() and action.isalpha() and len(action) <= 32):
                raise Malformed("instance-action has no action word")
            return Notice(self.source, action, parse_time(document.get("time"), "instance-action time"), received_at)
        if not self._hinted:
            found = self._document(REBALANCE_PATH, "rebalance recommendation")
            if found is not None:
                document, received_at = found
                issued = parse_time(document.get("noticeTime"), "rebalance noticeTime")
                self._hinted = True
                on_hint(Notice(self.source, "rebalance", issued, received_at))
        return None

    def _document(self, path: str, what: str) -> tuple[dict, float] | None:
        """The JSON object at `path` and when it was read; None while it is absent (404)."""
        response = self._get(path)
        if response is None:
            return None
        received_at = time.time()
        document = response.json()
        if not isinstance(document, dict):
            raise Malformed(f"{what} is not a JSON object")
        return document, received_at

    def _new_token(self, timeout: float = REQUEST_TIMEOUT_S) -> str:
        headers = {"X-aws-ec2-metadata-token-ttl-seconds": str(TOKEN_TTL_S)}
        response = self.endpoint.request("PUT", TOKEN_PATH, headers, timeout)
        if response.status != 200:
            raise Unavailable(f"PUT {TOKEN_PATH} answered {response.status}")
        return header_value(response.body, "the IMDSv2 token")

    def _get(self, path: str) -> Response | None:
        """The answer to GET `path`, None for 404; fetches a token first where needed."""
        for _ in range(2):
            if self._token is None:
                self._token = self._new_token()
            response = self.endpoint.request("GET", path, {"X-aws-ec2-metadata-token": self._token})
            if response.status == 401:
                log.debug("IMDSv2 token refused (expired); fetching a new one")
                self._token = None
                continue
            if response.status == 404:
                return None
            if response.status == 200:
                return response
            raise Unavailable(f"GET {path} answered {response.status}")
        raise Unavailable(f"GET {path} answered 401 to a new token")
