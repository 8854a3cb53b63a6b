"""Endpoints that share state through ember.Dict and ember.Queue."""

import ember

# At module level, as users write it: `ember deploy` imports this where no replica is.
counts = ember.Dict("counts")  # the replica's app, once used there


@ember.endpoint()
def tally(word: str) -> int:
    """Count a word in the app's dict; how many times it has been seen."""
    seen = counts.get(word, 0) + 1
    counts[word] = seen
    return seen


@ember.endpoint(timeout=60)
def worker(most: int = 2) -> list:
    """Take up to `most` jobs from the app's queue, waiting up to 20 s for the first."""
    return ember.Queue("jobs").get_many(most, timeout=20)
