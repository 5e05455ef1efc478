"""The client's transport: one registry's replicas behind one `request`, with the policy the
client module's doc states (a deadline per call, retries of connection errors, 503 and 429 paced
by the one back-off policy, failover across replicas, TLS failures said with the fix)."""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any, Self

import httpx

from registry_client.backoff import Backoff, retry_after
from registry_client.errors import ProblemError, RegistryUnavailable, problem_class
from registry_client.paths import check_path
from registry_client.paths import normalize_urls as _normalize_urls
from registry_client.tls import ClientTLS, tls_failure

DEFAULT_TIMEOUT_S = 10.0
# Extra time granted to an attempt that asked the server to hold the answer (wait_ready).
HOLD_MARGIN_S = 5.0
USER_AGENT = "engine-registry-workers"


class ReplicaTransport:
    """One registry's replicas behind one ``request`` (`RegistryClient` adds the contract's
    calls)."""

    def __init__(
        self,
        urls: str | Sequence[str],
        *,
        token: str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        connect_timeout_s: float = 2.0,
        backoff_base_s: float = 0.1,
        backoff_max_s: float = 2.0,
        transport: httpx.BaseTransport | None = None,
        tls: ClientTLS | None = None,
        rng: random.Random | None = None,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
        user_agent: str = USER_AGENT,
    ) -> None:
        """`user_agent`: who is asking, in the registry's access log (the vLLM plugin names
        its group, node, pid and role there)."""
        self.urls = _normalize_urls(urls)
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.backoff_base_s = backoff_base_s
        self.backoff_max_s = backoff_max_s
        self._rng = rng or random.Random()
        self._sleep = sleep
        self._clock = clock
        self._preferred = 0
        self.last_retry_after_s: float | None = None  # the last call's (publication.py)
        headers = {"Accept": "application/json, application/problem+json", "User-Agent": user_agent}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        # https:// URLs: verified against tls.ca (else the system store), never unverified.
        self.tls = tls or ClientTLS()
        self._http = httpx.Client(
            headers=headers, transport=transport, trust_env=False, verify=self.tls.context
        )

    @property
    def url(self) -> str:
        """The replica that answered last (or the first one)."""
        return self.urls[self._preferred]

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- transport ------------------------------------------------------------------------

    @property
    def http(self) -> httpx.Client:
        """The HTTP client every request goes through (its headers carry the token)."""
        return self._http

    def request(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        params: dict[str, Any] | None = None,
        timeout_s: float | None = None,
        hold_s: float = 0.0,
    ) -> httpx.Response:
        """One logical call: retried and failed over until `timeout_s` (+ `hold_s`) passes."""
        check_path(path)  # an id that escaped its segment never reaches another route
        budget = (self.timeout_s if timeout_s is None else timeout_s) + hold_s
        deadline = self._clock() + budget
        n = len(self.urls)
        attempt = 0
        last_exc: Exception | None = None
        last_problem: ProblemError | None = None
        tls_errors: dict[str, Exception] = {}
        backoff = Backoff(base_s=self.backoff_base_s, cap_s=self.backoff_max_s, rng=self._rng)
        self.last_retry_after_s = floor = None
        while True:
            index = (self._preferred + attempt) % n
            url = self.urls[index]
            remaining = deadline - self._clock()
            if remaining <= 0:
                break
            timeout = httpx.Timeout(remaining, connect=min(self.connect_timeout_s, remaining))
            try:
                response = self._http.request(
                    method, url + path, json=json, params=params, timeout=timeout
                )
            except httpx.TransportError as exc:
                tls_error = tls_failure(exc, url, self.tls)
                if tls_error is not None:  # a wrong CA, no client certificate: not weather
                    tls_errors[url] = tls_error
                    if len(tls_errors) == n:  # every replica refused: retrying cannot help
                        raise tls_error from exc
                last_exc = exc
            else:
                if response.status_code < 400:
                    self._preferred = index
                    return response
                problem = self._problem(response, url)
                if response.status_code not in (503, 429):
                    self._preferred = index
                    raise problem
                last_problem = problem
                after = retry_after(response.headers.get("retry-after"))
                if after is not None:
                    self.last_retry_after_s = floor = max(floor or 0.0, after)
            attempt += 1
            if attempt % n == 0:
                pause = min(backoff.next(floor), deadline - self._clock())
                floor = None
                if pause <= 0:
                    break
                self._sleep(pause)
        # A replica that answered 503 says more (missing_ranks, store down) than a refused
        # connection to another one does.
        if last_problem is not None:
            raise last_problem
        raise RegistryUnavailable(
            f"{method} {path}: no registry answered within {budget:.1f}s "
            f"(tried {', '.join(self.urls)}; last error: {last_exc!r})",
            urls=list(self.urls),
            attempts=attempt,
        ) from last_exc

    @staticmethod
    def _problem(response: httpx.Response, url: str) -> ProblemError:
        problem: dict[str, Any]
        try:
            body = response.json()
            problem = body if isinstance(body, dict) else {"detail": str(body)}
        except ValueError:
            problem = {"detail": response.text[:500]}
        problem.setdefault("status", response.status_code)
        cls = problem_class(response.status_code, problem)
        return cls(problem, status=response.status_code, url=url)
