"""What an endpoint declares: its settings (one dataclass, checked when the decorator
runs) and the parts they are made of (retries, schedules, engine metrics, node labels);
below the wire, which carries them.
"""
