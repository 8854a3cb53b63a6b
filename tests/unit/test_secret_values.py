"""`ember secret set`'s ways of giving values: KEY=VALUE, a bare KEY from this shell's
environment, and .env files."""

from __future__ import annotations

import pytest

from ember.cli.ops.secret import parse_dotenv, parse_pair
from ember.errors import InvalidError


def test_pairs_and_bare_keys_from_the_environment() -> None:
    assert parse_pair("TOKEN=abc=def") == ("TOKEN", "abc=def")  # the first = splits
    assert parse_pair("EMPTY=") == ("EMPTY", "")
    assert parse_pair("OPENAI_API_KEY", {"OPENAI_API_KEY": "sk-1"}) == ("OPENAI_API_KEY", "sk-1")
    with pytest.raises(InvalidError, match="has no MISSING to take its value from"):
        parse_pair("MISSING", {})
    with pytest.raises(InvalidError, match="is not KEY=VALUE"):
        parse_pair("=value")


def test_dotenv_files_skip_comments_exports_and_quotes() -> None:
    text = (
        "# keys\n\nexport A=1\nB = 'two words'\nC=\"x=y\"\nD=unquoted # a comment\n"
        "E=\"quoted # kept\" # a comment\nF=no#comment\nG='it''s'\n"
    )
    assert parse_dotenv(text) == {
        "A": "1",
        "B": "two words",
        "C": "x=y",
        "D": "unquoted",
        "E": "quoted # kept",
        "F": "no#comment",
        "G": "'it''s'",
    }
    with pytest.raises(InvalidError, match=r"line 2 of the \.env file"):
        parse_dotenv("A=1\nno equals sign\n")
