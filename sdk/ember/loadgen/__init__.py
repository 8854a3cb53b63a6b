"""Load generation for deployed endpoints: the pure parts of `ember bench`.

Each module is one concept: arrival schedules, request arguments, per-request timings,
statistics, SLOs, the async runner, the report, progress and the optional plot.
"""
