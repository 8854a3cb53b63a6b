"""Endpoints that call other endpoints of their app through the platform, from inside a
replica, with the address and credentials the replica was given."""

import time

import ember


@ember.endpoint(snapshot=False, concurrency=8)
def square(x: int) -> int:
    return x * x


@ember.endpoint(snapshot=False)
def count(to: int):
    yield from range(to)


@ember.endpoint(snapshot=False, concurrency=2)
def sum_of_squares(n: int) -> dict:
    squares = square.deployed().map({"x": i} for i in range(n))
    return {"total": sum(squares), "counted": list(count.deployed().stream(to=3))}


@ember.endpoint(snapshot=False)
async def square_async(x: int) -> int:
    return await square.deployed().acall(x=x)


@ember.endpoint(snapshot=False)
def credentials() -> dict:
    """What the replica's own token may do. For the tests only: never hand a token out."""
    from ember.calling.connections import platform_client
    from ember.config import load_config

    config = load_config()
    with platform_client(config, 30.0) as client:
        admin_only = client.get("/v1/tokens").status_code
    return {"app": ember.current_app(), "token": config.token, "admin_only_status": admin_only}


@ember.endpoint(snapshot=False, concurrency=4)
def slow_square(x: int) -> int:
    for _ in range(600):  # a minute, unless its caller goes
        if ember.cancelled():
            print(f"slow_square({x}) stopped: its caller is gone")
            return -1
        time.sleep(0.1)
    return x * x


@ember.endpoint(snapshot=False, concurrency=4)
def waits_on_slow(x: int) -> int:
    return slow_square.deployed().call(x=x)
