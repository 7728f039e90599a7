"""API keys and per-key rate limits: the key store and limiter against the real Redis, and the
gateway's HTTP and gRPC APIs refusing what they must (real processes on loopback)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import uuid

import grpc
from tests import patient_http as httpx
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedserve.launcher import build_parser as serve_parser
from pagedserve.launcher import gateway_secrets
from services.gateway.api_keys import ApiKey, RedisKeyStore, StaticKeys, key_id, redacted_url
from services.gateway.auth import Authenticator, bearer_token
from services.gateway.rate_limits import RateLimited, RateLimiter, Reservation, Window
from shared.grpc_errors import ServiceUnavailable, Unauthenticated
from shared.proto import pagedserve_api_pb2 as api
from shared.proto import pagedserve_api_pb2_grpc as api_grpc
from tests.services_harness import Stack, http_get

REDIS = "redis://127.0.0.1:6379/0"
UNREACHABLE = "redis://127.0.0.1:1/0"


def fresh_prefix() -> str:
    return f"pagedserve-test:{uuid.uuid4().hex[:12]}:"


async def delete_prefix(store: RedisKeyStore) -> None:
    keys = [k async for k in store.redis.scan_iter(match=store.prefix + "*")]
    if keys:
        await store.redis.delete(*keys)


# --- keys, tokens, windows -----------------------------------------------------------------------------

def test_bearer_tokens_and_static_keys():
    assert bearer_token("Bearer abc ") == "abc" and bearer_token("bearer  abc") == "abc"
    for bad in (None, "", "abc", "Basic abc", "Bearer", "Bearer   "):
        with pytest.raises(Unauthenticated):
            bearer_token(bad)
    keys = StaticKeys(["k1", "k2"])
    assert asyncio.run(keys.lookup("k2")) == ApiKey("api-key-1", key_id("k2"))
    assert asyncio.run(keys.lookup("k3")) is None
    with pytest.raises(ValueError, match="empty"):
        StaticKeys([""])
    with pytest.raises(ValueError, match="requests_per_minute"):
        ApiKey("x", "id", requests_per_minute=0)


def test_the_sliding_window_weighs_the_previous_minute_by_what_it_still_covers():
    # A quarter into the minute, three quarters of the previous minute's 40 still count.
    assert Window(previous=40, current=10, elapsed=0.25).estimate() == 40
    # Room for one more under 41: now (but at least a second). Under 40 (full): once 1/40 of the
    # previous minute's weight is gone, 1.5 s later. Under 10: not this minute (10 are in it),
    # but 1 - 9/10 into the next.
    assert Window(40, 10, 0.25).seconds_until(1, 41) == 1
    assert Window(40, 10, 0.25).seconds_until(1, 40) == 2
    assert Window(40, 10, 0.25).seconds_until(1, 10) == 45 + 6
    assert Window(0, 5, 0.5).seconds_until(1, 5) == 30 + 12


def in_fresh_store(run) -> None:
    """asyncio.run(run(store)) on a store under a prefix of its own, deleted afterwards."""
    store = RedisKeyStore(REDIS, fresh_prefix())
    try:
        asyncio.run(run(store))
    finally:
        asyncio.run(_cleanup(store))


async def _cleanup(store: RedisKeyStore) -> None:
    import redis.asyncio

    store.redis = redis.asyncio.Redis.from_url(REDIS, decode_responses=True)  # a fresh loop: a fresh client
    await delete_prefix(store)
    await store.close()


def test_the_store_keeps_hashes_names_and_limits_and_revokes():
    async def run(store):
        key, record = await store.create("team-a", requests_per_minute=5)
        assert key.startswith("ps-") and len(key) > 40
        assert await store.lookup(key) == record == ApiKey("team-a", key_id(key), 5, None)
        raw = [k async for k in store.redis.scan_iter(match=store.prefix + "*")]
        assert all(key not in k for k in raw)  # only the hash is kept
        for name in raw:
            assert key not in str(await store.redis.hgetall(name))
        with pytest.raises(ValueError, match="exists already"):
            await store.create("team-a")
        with pytest.raises(ValueError, match="name"):
            await store.create("")
        other, _ = await store.create("team-b", tokens_per_minute=100)
        assert [r.name for r, _ in await store.list()] == ["team-a", "team-b"]
        assert await store.revoke("team-a") and not await store.revoke("team-a")
        assert await store.lookup(key) is None and (await store.lookup(other)).tokens_per_minute == 100
        await store.create("team-a")  # the name is free again

    in_fresh_store(run)


def test_limits_are_shared_counted_once_and_taken_back_when_refused():
    now = [600.0]  # a minute boundary, on a clock of our own

    async def run(store):
        limiter = RateLimiter(store.redis, store.prefix, clock=lambda: now[0])
        other_gateway = RateLimiter(store.redis, store.prefix, clock=lambda: now[0])
        key = ApiKey("k", "id-" + uuid.uuid4().hex, requests_per_minute=3)
        await limiter.admit(key)
        await other_gateway.admit(key)
        await limiter.admit(key)
        for _ in range(3):  # refusals do not count: the window stays at 3
            with pytest.raises(RateLimited) as refused:
                await other_gateway.admit(key)
        assert refused.value.kind == "requests" and refused.value.limit == 3
        # This minute's 3 weigh on the next one: one more fits once a third of their weight is gone.
        assert refused.value.retry_after_s == 60 + 20
        now[0] += 90  # half into the next minute: 3 * 0.5 + 1 <= 3, but not + 2
        await limiter.admit(key)
        with pytest.raises(RateLimited):
            await limiter.admit(key)
        tokens = ApiKey("t", "id-" + uuid.uuid4().hex, tokens_per_minute=100)
        await limiter.admit(tokens)  # no request limit: nothing counted
        first = await limiter.reserve_tokens(tokens, 500)  # the window was empty: it may overshoot...
        with pytest.raises(RateLimited) as refused:  # ...but a request beside it waits
            await limiter.reserve_tokens(tokens, 1)
        await limiter.settle(tokens, first, 99)  # it used 99 of its 500
        second = await limiter.reserve_tokens(tokens, 30)  # 99 < 100
        await limiter.settle(tokens, second, 1)
        with pytest.raises(RateLimited) as refused:
            await limiter.reserve_tokens(tokens, 1)
        assert refused.value.kind == "tokens" and refused.value.limit == 100
        assert refused.value.retry_after_s == 30 + 1  # the next minute, once 1/100 of these has gone
        now[0] += 120  # a request that ends two minutes on: its reservation is not taken from the new window
        await limiter.settle(tokens, Reservation(first.minute, 400), 10)
        assert int(await store.redis.get(f"{store.prefix}rate:{tokens.key_id}:tokens:{first.minute + 2}")) == 10
        assert await limiter.reserve_tokens(ApiKey("r", "id-" + uuid.uuid4().hex), 10) is None  # no token limit
        unlimited = ApiKey("u", "id-" + uuid.uuid4().hex)
        for _ in range(10):
            await limiter.admit(unlimited)  # nothing counted, nothing refused
        assert not [k async for k in store.redis.scan_iter(match=f"{store.prefix}rate:{unlimited.key_id}*")]
        ttl = await store.redis.ttl(f"{store.prefix}rate:{key.key_id}:requests:10")
        assert 0 < ttl <= 120  # counters expire on their own

    in_fresh_store(run)


def test_an_unreachable_store_is_a_503_not_a_401():
    async def run():
        auth = Authenticator(StaticKeys(["static"]), RedisKeyStore(UNREACHABLE))
        assert (await auth.authenticate("Bearer static")).name == "api-key-0"  # static keys need no store
        with pytest.raises(ServiceUnavailable, match="unreachable"):
            await auth.authenticate("Bearer other")
        with pytest.raises(Unauthenticated):
            await auth.authenticate(None)
        await auth.close()
        assert await Authenticator().authenticate(None) is None  # no keys configured: open

    asyncio.run(run())


def test_a_store_url_s_password_never_reaches_a_message():
    store = RedisKeyStore("redis://default:hunter2@127.0.0.1:1/0")
    assert store.url == "redis://default:***@127.0.0.1:1/0" and redacted_url(REDIS) == REDIS

    async def run():
        with pytest.raises(ServiceUnavailable) as failed:
            await Authenticator(store=store).authenticate("Bearer x")
        assert "hunter2" not in str(failed.value)
        await store.close()

    asyncio.run(run())


def test_the_concurrency_limit_holds_while_the_limiter_is_asked():
    """The slot is taken before the rate check's round trip, so concurrent requests cannot all pass."""
    from services.gateway.generator import Generator, Overloaded
    from services.gateway.metrics import GatewayMetrics

    class SlowLimiter:
        async def admit(self, key):
            await asyncio.sleep(0.05)

    async def run():
        gen = Generator(None, GatewayMetrics(), max_concurrent_requests=2, limiter=SlowLimiter())
        key = ApiKey("k", "id", requests_per_minute=1000)
        peak = 0

        async def one():
            nonlocal peak
            async with gen.admitted(key):
                peak = max(peak, gen.in_flight)
                await asyncio.sleep(0.1)

        results = await asyncio.gather(*(one() for _ in range(10)), return_exceptions=True)
        assert peak <= 2 and sum(isinstance(r, Overloaded) for r in results) == 8 and gen.in_flight == 0

    asyncio.run(run())


def test_requests_the_service_fails_before_they_run_do_not_count():
    from services.gateway.generator import Generator
    from services.gateway.metrics import GatewayMetrics

    async def run(store):
        gen = Generator(None, GatewayMetrics(), limiter=RateLimiter(store.redis, store.prefix))
        key = ApiKey("k", "id-" + uuid.uuid4().hex, requests_per_minute=2)
        for _ in range(5):  # the scheduler is down: a client retrying keeps its quota
            with pytest.raises(ServiceUnavailable):
                async with gen.admitted(key):
                    raise ServiceUnavailable("the scheduler is not reachable")
            await gen.settle_charges()
        for _ in range(2):
            with pytest.raises(ServiceUnavailable):
                async with gen.admitted(key) as admission:
                    admission.runs = ["ran"]  # started: it counts, whatever happens next
                    raise ServiceUnavailable("the scheduler went away mid-stream")
            await gen.settle_charges()
        with pytest.raises(RateLimited):
            async with gen.admitted(key):
                pass

    in_fresh_store(run)


def test_serve_hands_keys_to_the_gateway_in_its_environment_not_its_command_line():
    args = serve_parser().parse_args(["--api-key", "a", "--api-key", "b", "--api-key-store", REDIS])
    assert gateway_secrets(args) == {"PAGEDSERVE_API_KEY": "a,b", "PAGEDSERVE_API_KEY_STORE": REDIS}
    with pytest.raises(ValueError, match="comma"):
        gateway_secrets(serve_parser().parse_args(["--api-key", "a,b"]))
    assert gateway_secrets(serve_parser().parse_args([])) == {}


# --- the gateway ------------------------------------------------------------------------------------------

STATIC_KEY = "static-" + uuid.uuid4().hex


@pytest.fixture(scope="module")
def keys():
    """Keys in the real store under a prefix of this run's own: (store prefix, {name: key})."""
    prefix = fresh_prefix()

    async def make():
        store = RedisKeyStore(REDIS, prefix)
        made = {"rpm2": (await store.create("rpm2", requests_per_minute=2))[0],
                "tpm": (await store.create("tpm", tokens_per_minute=30))[0],
                "plain": (await store.create("plain"))[0],
                "doomed": (await store.create("doomed"))[0]}
        await store.close()
        return made

    made = asyncio.run(make())
    yield prefix, made
    asyncio.run(_cleanup(RedisKeyStore(REDIS, prefix)))


@pytest.fixture(scope="module")
def stack(llama_dir, tmp_path_factory, keys):
    prefix, _ = keys
    stack = Stack(llama_dir, tmp_path_factory.mktemp("auth-logs"), worker_args=("--num-gpu-blocks-override", "256"),
                  gateway_args=("--api-key", STATIC_KEY, "--api-key-store", REDIS,
                                "--api-key-store-prefix", prefix)).start(headers=bearer(STATIC_KEY))
    try:
        yield stack
    finally:
        stack.stop()


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def completion(stack, key: str | None, **body) -> httpx.Response:
    return httpx.post(f"{stack.base_url}/v1/completions", headers=bearer(key) if key else {}, timeout=30,
                      json={"prompt": "Hello there", "max_tokens": 4, "temperature": 0, **body})


def test_requests_without_a_known_key_get_401_and_probes_stay_open(stack):
    for key in (None, "wrong-key-1234567", ):
        reply = completion(stack, key)
        assert reply.status_code == 401 and reply.headers["www-authenticate"] == "Bearer"
        error = reply.json()["error"]
        assert error["code"] == "invalid_api_key" and error["type"] == "AuthenticationError"
        assert "wro***4567" in error["message"] if key else "no API key" in error["message"]
    assert httpx.get(f"{stack.base_url}/v1/models", headers={"Authorization": "Basic eDp5"}).status_code == 401
    assert httpx.post(f"{stack.base_url}/tokenize", json={"prompt": "hi"}).status_code == 401
    for path in ("/health", "/metrics", "/version", "/openapi.json"):
        assert http_get(f"{stack.base_url}{path}")[0] == 200, path
    preflight = httpx.options(f"{stack.base_url}/v1/completions", headers={
        "Origin": "https://example.com", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type"})
    assert preflight.status_code == 200  # browsers send no credentials with it
    refused = httpx.get(f"{stack.base_url}/v1/models", headers={"Origin": "https://example.com"})
    assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == "*"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="nope", max_retries=0).models.list()
    assert "pagedserve_unauthenticated_requests_total" in http_get(f"{stack.base_url}/metrics")[1]


def test_static_and_stored_keys_serve_and_a_revoked_key_stops_at_once(stack, keys):
    prefix, made = keys
    client = openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key=STATIC_KEY, max_retries=0, timeout=30)
    text = client.completions.create(model=client.models.list().data[0].id, prompt="Hello there", max_tokens=4,
                                     temperature=0).choices[0].text
    reply = completion(stack, made["doomed"])
    assert reply.status_code == 200 and reply.json()["choices"][0]["text"] == text

    async def revoke():
        store = RedisKeyStore(REDIS, prefix)
        assert await store.revoke("doomed")
        await store.close()

    asyncio.run(revoke())
    assert completion(stack, made["doomed"]).status_code == 401


def test_requests_per_minute_over_http_and_grpc(stack, keys):
    _, made = keys
    assert completion(stack, made["rpm2"]).status_code == 200
    with grpc.insecure_channel(f"127.0.0.1:{stack.grpc_port}") as channel:
        stub = api_grpc.GenerationStub(channel)
        request = api.GenerateRequest(text="Hello there", params=api.SamplingParameters(max_tokens=3, temperature=0))
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.Generate(request, timeout=30))
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as refused:
            stub.ListModels(api.ListModelsRequest(), metadata=(("authorization", "Bearer nope"),), timeout=10)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING  # probes carry no key
        outputs = list(stub.Generate(request, metadata=(("authorization", f"Bearer {made['rpm2']}"),), timeout=30))
        assert outputs[-1].finish_reason == "length"  # the key's second request this minute
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.Generate(request, metadata=(("authorization", f"Bearer {made['rpm2']}"),), timeout=30))
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "2 requests per minute" in refused.value.details()
        assert int(dict(refused.value.trailing_metadata())["retry-after"]) >= 1
    reply = completion(stack, made["rpm2"])
    assert reply.status_code == 429
    assert reply.json()["error"]["code"] == "rate_limit_exceeded" and reply.json()["error"]["type"] == "requests"
    assert reply.headers["x-ratelimit-limit-requests"] == "2" and int(reply.headers["retry-after"]) >= 1
    with pytest.raises(openai.RateLimitError):
        openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key=made["rpm2"], max_retries=0).completions.create(
            model=stack.model_name, prompt="hi", max_tokens=1)
    assert completion(stack, made["plain"]).status_code == 200  # other keys are not affected
    # /metrics is open to scrapers: the key is labelled by its hash's prefix (api-keys list shows it), not its name.
    metrics = http_get(f"{stack.base_url}/metrics")[1]
    assert f'pagedserve_rate_limited_requests_total{{api_key_sha256="{key_id(made["rpm2"])[:16]}"}}' in metrics
    assert "rpm2" not in metrics


def test_tokens_per_minute_reserve_what_concurrent_requests_may_use(stack, keys):
    _, made = keys
    body = {"max_tokens": 30, "ignore_eos": True}
    with concurrent.futures.ThreadPoolExecutor(6) as pool:  # all at once: each sees the others' reservations
        replies = list(pool.map(lambda _: completion(stack, made["tpm"], **body), range(6)))
    assert sorted(r.status_code for r in replies) == [200] + [429] * 5  # the first of the window overshoots
    refused = next(r for r in replies if r.status_code == 429)
    assert refused.json()["error"]["type"] == "tokens" and "30 tokens per minute" in refused.json()["error"]["message"]
    assert refused.headers["x-ratelimit-limit-tokens"] == "30"
    # It used all it reserved (prompt + 30): the window stays full, a stream included.
    reply = httpx.post(f"{stack.base_url}/v1/completions", headers=bearer(made["tpm"]), timeout=30,
                       json={"prompt": "Hello there", "max_tokens": 5, "stream": True})
    assert reply.status_code == 429


def test_grpc_request_ids_belong_to_their_key(stack, keys):
    _, made = keys
    params = api.SamplingParameters(max_tokens=40, temperature=0, ignore_eos=True)
    mine = (("authorization", f"Bearer {made['plain']}"),)
    theirs = (("authorization", f"Bearer {STATIC_KEY}"),)
    with grpc.insecure_channel(f"127.0.0.1:{stack.grpc_port}") as channel:
        stub = api_grpc.GenerationStub(channel)
        stream = stub.Generate(api.GenerateRequest(request_id="job-1", text="Hello", params=params), metadata=mine,
                               timeout=60)
        first = next(stream)
        assert first.request_id == "job-1"
        # Another key: the id is free for it, and an Abort of it does not reach the first key's request.
        assert not stub.Abort(api.AbortRequest(request_id="job-1"), metadata=theirs, timeout=10).found
        other = list(stub.Generate(api.GenerateRequest(request_id="job-1", text="Hi", params=api.SamplingParameters(
            max_tokens=2)), metadata=theirs, timeout=60))
        assert other[-1].finish_reason == "length" and other[-1].request_id == "job-1"
        rest = list(stream)
        assert rest[-1].finish_reason == "length"  # not "abort"
        assert len(first.token_ids) + sum(len(r.token_ids) for r in rest) == 40
