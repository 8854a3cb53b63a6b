"""Commands that call endpoints: call, calls, map, bench."""
