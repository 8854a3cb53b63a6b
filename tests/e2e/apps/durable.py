"""An endpoint for the test of async calls across a control-plane restart."""

import time

import ember


@ember.endpoint(retries=3)
def slow_square(x: int, seconds: float = 2.0) -> dict:
    time.sleep(seconds)
    return {"square": x * x}
