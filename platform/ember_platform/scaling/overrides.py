"""Autoscaling settings changed without a redeploy (`ember scale`): more replicas kept
warm before a launch, a lower cap while a quota runs out.

An override names some of an endpoint's autoscaling settings; the rest stay as deployed.
It holds for the version it was set on, across control-plane restarts, until it is
reset or the app is deployed again (a rollback too), as the new version's code says
what it wants.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ember.declarations.settings import EndpointSettings
from ember.errors import InvalidError

# What an override may change: settings only the control plane reads, so that replicas
# (and their snapshots) are the same with or without one.
SCALABLE = ("min_replicas", "max_replicas", "buffer_replicas", "scaledown_window")


def parse_override(payload: Any) -> dict[str, int | float | None]:
    """The settings a request asks to change ({} for none); None for a setting resets
    it to the deployed value. InvalidError says what is wrong."""
    if not isinstance(payload, dict):
        raise InvalidError('send a JSON object such as {"min_replicas": 2}')
    unknown = sorted(set(payload) - set(SCALABLE))
    if unknown:
        raise InvalidError(
            f"{unknown[0]!r} cannot be changed without a deploy; these can: {', '.join(SCALABLE)}"
        )
    override: dict[str, int | float | None] = {}
    for name, value in payload.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
            raise InvalidError(f"{name} must be a number, not {value!r}")
        override[name] = value
    return override


def merged(current: dict[str, Any], change: dict[str, Any]) -> dict[str, Any]:
    """The override after `change`: its settings set, those given as None dropped."""
    result = {**current, **change}
    return {name: value for name, value in result.items() if value is not None}


def effective_settings(deployed: EndpointSettings, override: dict[str, Any]) -> EndpointSettings:
    """The deployed settings with the override's in their place, checked as a deploy
    checks them (InvalidError: max_replicas below min_replicas, out of range)."""
    return dataclasses.replace(deployed, **override) if override else deployed
