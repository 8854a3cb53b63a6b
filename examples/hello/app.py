"""Two endpoints: a plain function and a generator that streams server-sent events.

ember deploy examples/hello/app.py
ember call hello--greet '{"name": "Ada"}'
ember call hello--count '{"to": 3}' --stream
"""

import time

import ember


@ember.endpoint(max_replicas=3, concurrency=4, scaledown_window=30)
def greet(name: str = "world", excited: bool = False) -> dict:
    greeting = f"Hello, {name}" + ("!" if excited else ".")
    return {"greeting": greeting}


@ember.endpoint(max_replicas=2, concurrency=8)
def count(to: int = 5, delay: float = 0.1):
    for number in range(1, to + 1):
        time.sleep(delay)
        yield {"number": number}
