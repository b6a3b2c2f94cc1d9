"""Who may call the API, and how often: API keys and a per-user rate limit.

With users (a UserDirectory: keys stored hashed, disabled users refused; or a users dict),
`Authorization: Bearer <api_key>` must match a user's key; that user's name
goes to the engine as `user=` (the same identity, salt and cache isolation as in the UI). Without
users (local single-user mode) any key, or none, is accepted and the user is None.
"""

import math
import threading
import time

from starlette.requests import Request

from chatengine.app.api.protocol import APIError
from chatengine.app.auth import user_for_api_key
from chatengine.app.users import UserDirectory


class RateLimiter:
    """A token bucket per key: `per_minute` requests, refilled continuously; bursts up to `per_minute`."""

    def __init__(self, per_minute: int):
        if isinstance(per_minute, bool) or not isinstance(per_minute, int) or per_minute < 1:
            raise ValueError(f"rate_limit_per_minute must be a positive integer or None, got {per_minute!r}")
        self.per_minute = per_minute
        self.capacity = float(per_minute)
        self.rate = per_minute / 60.0
        self.buckets: dict[str | None, tuple[float, float]] = {}
        self.lock = threading.Lock()  # requests with several prompts are charged from worker threads

    def check(self, key: str | None, cost: float = 1.0) -> float:
        """0.0 if allowed (`cost` tokens are taken), else the seconds to wait."""
        with self.lock:
            now = time.monotonic()
            tokens, last = self.buckets.get(key, (self.capacity, now))
            tokens = min(self.capacity, tokens + (now - last) * self.rate)
            if tokens >= cost:
                self.buckets[key] = (tokens - cost, now)
                return 0.0
            self.buckets[key] = (tokens, now)
            return (cost - tokens) / self.rate


class Access:
    """The API keys of `users` (None: local mode, no keys) and an optional per-user rate limit."""

    def __init__(self, users: dict | UserDirectory | None, rate_limit_per_minute: int | None = None):
        if users is not None and not isinstance(users, (dict, UserDirectory)):
            raise ValueError("users must be a dict (see chatengine.app.auth.load_users), a UserDirectory or None")
        self.users = users
        self.limiter = RateLimiter(rate_limit_per_minute) if rate_limit_per_minute is not None else None

    def authenticate(self, request: Request) -> str | None:
        """The caller's user name (None in local mode); 401 for a missing or wrong key."""
        if self.users is None:
            return None
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise APIError(
                401, "missing API key: send the header 'Authorization: Bearer <api_key>'", code="invalid_api_key"
            )
        try:  # headers arrive as latin-1; keys are stored as UTF-8 text
            token = token.encode("latin-1").decode("utf-8")
        except UnicodeError:
            pass
        # a UserDirectory (the server: hashed keys in the database) or a users dict (tests, embedders)
        if isinstance(self.users, dict):
            user = user_for_api_key(self.users, token)
        else:
            user = self.users.user_for_api_key(token)
        if user is None:
            # with a rate limit, wrong keys also spend a per-address budget: no free key guessing
            host = request.client.host if request.client else "?"
            if self.limiter is not None and self.limiter.check(f"addr:{host}") > 0:
                raise APIError(
                    429,
                    "too many requests with a wrong API key; slow down",
                    type="requests",
                    code="rate_limit_exceeded",
                    headers={"Retry-After": "60"},
                )
            raise APIError(401, "incorrect API key provided", code="invalid_api_key")
        return user

    def rate_limit(self, user: str | None, cost: int = 1, why: str | None = None) -> None:
        """429 (with Retry-After) when `user` has used up their requests of the last minute. `cost`:
        how many requests to take; `why` (several prompts in one completions request, after the
        request itself took one): a request that can never fit the limit is told so."""
        if self.limiter is None:
            return
        if why is not None and cost + 1 > self.limiter.capacity:
            raise APIError(
                429,
                f"{why}, each counted as a request; this server allows each user {self.limiter.per_minute} "
                "requests a minute: send fewer prompts in one request",
                type="requests",
                code="rate_limit_exceeded",
                headers={"Retry-After": "60"},
            )
        wait = self.limiter.check(user, cost)
        if wait > 0:
            raise APIError(
                429,
                f"rate limit reached: at most {self.limiter.per_minute} requests per minute; "
                f"retry in {math.ceil(wait)} s",
                type="requests",
                code="rate_limit_exceeded",
                headers={"Retry-After": str(math.ceil(wait))},
            )
