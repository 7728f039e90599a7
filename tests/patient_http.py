"""httpx2 with the tests' timeout in place of its 5 s default.

The suite runs two test processes on two cores beside the services they start, so a loaded machine
can take longer than 5 s to answer a request that is not at fault. A call that means to time out
passes its own timeout, which overrides this one.
"""
from __future__ import annotations

import functools

import httpx2
from httpx2 import *  # noqa: F401,F403 (exceptions, Response, Timeout…)

TIMEOUT_S = 60.0

request = functools.partial(httpx2.request, timeout=TIMEOUT_S)
get = functools.partial(httpx2.get, timeout=TIMEOUT_S)
post = functools.partial(httpx2.post, timeout=TIMEOUT_S)
options = functools.partial(httpx2.options, timeout=TIMEOUT_S)
stream = functools.partial(httpx2.stream, timeout=TIMEOUT_S)
Client = functools.partial(httpx2.Client, timeout=TIMEOUT_S)
