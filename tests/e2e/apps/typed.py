"""Endpoints whose arguments and results are Pydantic models and dataclasses."""

import enum
from dataclasses import dataclass

from pydantic import BaseModel, Field

import ember


class Review(BaseModel):
    text: str
    stars: int = Field(ge=1, le=5)


class Verdict(BaseModel):
    positive: bool
    stars: int


@dataclass
class Point:
    x: float
    y: float = 0.0


@ember.endpoint()
def judge(review: Review) -> Verdict:
    """Whether a review is positive."""
    assert isinstance(review, Review)  # built by the platform, not a dict
    return Verdict(positive=review.stars >= 4, stars=review.stars)


@ember.endpoint()
def centre(points: list[Point]) -> Point:
    assert all(isinstance(p, Point) for p in points)
    return Point(sum(p.x for p in points) / len(points), sum(p.y for p in points) / len(points))


@ember.endpoint()
def sizes(blobs: list[bytes], named: dict[str, bytes] | None = None) -> dict:
    """bytes inside lists and dicts: base64 in JSON, bytes in the code."""
    assert all(isinstance(b, bytes) for b in blobs)
    return {
        "blobs": [len(b) for b in blobs],
        "named": {k: v.decode() for k, v in (named or {}).items()},
    }


class Colour(enum.Enum):
    RED = "red"
    GREEN = "green"


@ember.endpoint()
def paint(colour: Colour, shades: list[Colour] | None = None) -> dict:
    assert isinstance(colour, Colour)
    return {"colour": colour, "shades": [s.name for s in shades or []]}
