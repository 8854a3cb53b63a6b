"""Endpoint labels and how request URLs map onto them."""

from __future__ import annotations

import pytest

from ember.errors import InvalidError
from ember.wire.labels import (
    Route,
    checked_domain,
    endpoint_urls,
    make_label,
    route_request,
    split_label,
)
from ember.wire.spec import FUNCTION_METHOD

CALL = FUNCTION_METHOD

# --- make_label / split_label ----------------------------------------------------------


@pytest.mark.parametrize(
    ("app", "endpoint"),
    [("app", "ep"), ("my-app", "chat-v2"), ("a", "b"), ("0", "9"), ("a" * 48, "b" * 48)],
)
def test_make_and_split_round_trip(app: str, endpoint: str) -> None:
    label = make_label(app, endpoint)
    assert label == f"{app}--{endpoint}"
    assert split_label(label) == (app, endpoint)


@pytest.mark.parametrize(
    "label",
    [
        "app",  # no separator
        "app-ep",  # a single hyphen is part of a name
        "",
        "--ep",  # empty app
        "app--",  # empty endpoint
        "--",
        "app--ep--x--y",  # a workspace, an app, an endpoint: three parts at most
        "a----b",  # four hyphens: the endpoint part starts with '--'
        "---",
    ],
)
def test_split_label_rejects(label: str) -> None:
    assert split_label(label) is None


def test_split_label_triple_hyphen_splits_at_first_separator() -> None:
    # 'a---b' could only be 'a-' + 'b' or 'a' + '-b'; the split is at the first '--'.
    result = split_label("a---b")
    assert result is None or result[0] == "a"


@pytest.mark.parametrize("label", ["a---b", "a---"])
def test_split_label_triple_hyphen_is_not_well_formed(label: str) -> None:
    assert split_label(label) is None


# --- route_request: path form ------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("/app--ep/", Route("app--ep", CALL, False, "/app--ep")),
        ("/app--ep", Route("app--ep", CALL, False, "/app--ep")),
        ("/app--ep/generate", Route("app--ep", "generate", True, "/app--ep")),
        ("/app--ep/generate/", Route("app--ep", "generate", True, "/app--ep")),
        ("//app--ep//generate", Route("app--ep", "generate", True, "/app--ep")),
        # A method's own path (@ember.method(path=...)), such as OpenAI clients call.
        ("/app--ep/v1/chat/completions", Route("app--ep", "v1/chat/completions", True, "/app--ep")),
        ("/app--ep/v1//models/", Route("app--ep", "v1/models", True, "/app--ep")),
    ],
)
@pytest.mark.parametrize("domain", [None, "example.com"])
def test_path_form(path: str, expected: Route, domain: str | None) -> None:
    assert route_request("127.0.0.1:8443", path, domain) == expected


@pytest.mark.parametrize(
    "path",
    [
        "/",
        "",
        "/a/b/c",
        "/app",  # not a label
        "/v1/calls",  # not a label (the API lives here)
        "/app--/m",
        "/--ep",
    ],
)
def test_path_form_not_a_route(path: str) -> None:
    assert route_request("127.0.0.1:8443", path, None) is None
    assert route_request("127.0.0.1:8443", path, "example.com") is None


@pytest.mark.parametrize("host", ["[::1]:8443", "[::1]", "localhost", "ember.internal:443"])
def test_path_form_any_host(host: str) -> None:
    assert route_request(host, "/app--ep/m", None) == Route("app--ep", "m", True, "/app--ep")


# --- route_request: wildcard-domain form -------------------------------------------------


@pytest.mark.parametrize(
    "host",
    [
        "app--ep.example.com",
        "app--ep.example.com:8443",
        "app--ep.example.com.",  # fully qualified, trailing dot
        "app--ep.example.com.:443",
        "APP--EP.Example.COM",
        "App--Ep.example.com:8443",
    ],
)
def test_domain_form(host: str) -> None:
    assert route_request(host, "/", "example.com") == Route("app--ep", CALL, False)
    assert route_request(host, "", "example.com") == Route("app--ep", CALL, False)
    assert route_request(host, "/generate", "example.com") == Route("app--ep", "generate", True)


@pytest.mark.parametrize("domain", ["example.com", "Example.COM", "example.com."])
def test_domain_setting_is_normalized(domain: str) -> None:
    assert route_request("app--ep.example.com", "/m", domain) == Route("app--ep", "m", True)


def test_domain_form_with_a_method_path() -> None:
    assert route_request("app--ep.example.com", "/v1/chat/completions", "example.com") == Route(
        "app--ep", "v1/chat/completions", True
    )


def test_domain_form_wins_over_path() -> None:
    # The host names the endpoint; a path segment is a method, even if it looks like a label.
    assert route_request("app--ep.example.com", "/other--ep", "example.com") == Route(
        "app--ep", "other--ep", True
    )


@pytest.mark.parametrize(
    "host",
    [
        "x.app--ep.example.com",  # nested subdomain
        "www.example.com",  # a subdomain that is not a label
        "example.com",  # the domain itself
        "app--ep.example.org",  # not under the domain
        "app--ep.notexample.com",  # suffix match must be on a dot boundary
        "127.0.0.1:8443",
    ],
)
def test_domain_configured_but_host_does_not_match_falls_back_to_path(host: str) -> None:
    other = "/other--ep"
    assert route_request(host, "/other--ep/m", "example.com") == Route(
        "other--ep", "m", True, other
    )
    assert route_request(host, "/other--ep", "example.com") == Route(
        "other--ep", CALL, False, other
    )
    assert route_request(host, "/", "example.com") is None


def test_no_domain_ignores_host() -> None:
    assert route_request("app--ep.example.com", "/", None) is None
    assert route_request("app--ep.example.com", "/m", None) is None
    assert route_request("app--ep.example.com", "/x--y/m", None) == Route(
        "x--y", "m", True, "/x--y"
    )
    assert route_request("app--ep.example.com", "/", "") is None


# --- endpoint_urls -----------------------------------------------------------------------


def test_urls_without_domain() -> None:
    assert endpoint_urls("app--ep", "https://127.0.0.1:8443", None) == [
        "https://127.0.0.1:8443/app--ep/"
    ]
    assert endpoint_urls("app--ep", "https://127.0.0.1:8443/", None) == [
        "https://127.0.0.1:8443/app--ep/"
    ]


@pytest.mark.parametrize(
    ("base", "expected"),
    [
        (
            "https://127.0.0.1:8443",
            ["https://app--ep.example.com:8443/", "https://127.0.0.1:8443/app--ep/"],
        ),
        (
            "https://ember.internal:8443/",
            ["https://app--ep.example.com:8443/", "https://ember.internal:8443/app--ep/"],
        ),
        (
            "https://ember.internal",
            ["https://app--ep.example.com/", "https://ember.internal/app--ep/"],
        ),
        (
            "http://[::1]:8080",
            ["http://app--ep.example.com:8080/", "http://[::1]:8080/app--ep/"],
        ),
        (
            "https://[::1]",
            ["https://app--ep.example.com/", "https://[::1]/app--ep/"],
        ),
        (
            "https://lb.example.net:443/prefix",
            ["https://app--ep.example.com:443/", "https://lb.example.net:443/prefix/app--ep/"],
        ),
    ],
)
def test_urls_with_domain(base: str, expected: list[str]) -> None:
    urls = endpoint_urls("app--ep", base, "example.com")
    assert urls == expected


def test_urls_route_back_to_the_label() -> None:
    domain_url, path_url = endpoint_urls("app--ep", "https://127.0.0.1:8443", "example.com")
    host = domain_url.split("://")[1].rstrip("/")
    assert route_request(host, "/", "example.com") == Route("app--ep", CALL, False)
    path = "/" + path_url.split("://")[1].split("/", 1)[1]
    assert route_request("127.0.0.1:8443", path, "example.com") == Route(
        "app--ep", CALL, False, "/app--ep"
    )


def test_a_label_a_user_typed_is_checked_and_upper_case_is_said_so() -> None:
    from ember.wire.labels import checked_label

    assert checked_label("app--echo") == ("app", "echo")
    with pytest.raises(InvalidError, match=r"names are lower case: 'snap1--snap'"):
        checked_label("snap1--Snap")
    with pytest.raises(InvalidError, match=r"labels look like APP--ENDPOINT, or WORKSPACE--"):
        checked_label("nolabel")


def test_labels_outside_main_name_their_workspace_first() -> None:
    from ember.wire.labels import app_key, checked_app_key, split_app_key, split_label

    assert split_label("team--app--echo") == ("team--app", "echo")
    assert split_label("app--echo") == ("app", "echo")
    # One endpoint, one label: main's endpoints have two parts only.
    assert split_label("main--app--echo") is None
    for bad in ("a--b--c--d", "a----b", "-a--b", "a--b-", "A--b--c", "a--b--c\n"):
        assert split_label(bad) is None, bad
    assert app_key("main", "app") == "app" and app_key("team", "app") == "team--app"
    assert split_app_key("team--app") == ("team", "app")
    assert split_app_key("app") == ("main", "app")
    assert checked_app_key("app") == (None, "app")
    assert checked_app_key("team--app") == ("team", "app")
    assert checked_app_key("a--b--c") is None and checked_app_key("Team--app") is None


def test_a_labels_names_come_from_the_one_parser() -> None:
    from ember.wire.labels import label_names

    # Never split at the first `--`: `team--shop--fn` is app shop of team, not app team.
    assert label_names("team--shop--fn") == ("team", "shop", "fn")
    assert label_names("shop--fn") == ("main", "shop", "fn")
    assert label_names("main--shop--fn") is None and label_names("a--b--c--d") is None


# --- checked_domain: what --domain may be ------------------------------------------------


@pytest.mark.parametrize(
    ("given", "spelt"),
    [
        ("ember.test", "ember.test"),
        ("Ember.Test", "ember.test"),  # printed and compared in lower case
        ("ember.test.", "ember.test"),
        (" ember.test ", "ember.test"),
        ("bücher.test", "xn--bcher-kva.test"),  # as Host headers and certificates spell it
        ("BÜCHER.Test", "xn--bcher-kva.test"),
        ("xn--bcher-kva.test", "xn--bcher-kva.test"),
        ("localhost", "localhost"),
    ],
)
def test_a_domain_is_spelt_as_hosts_spell_it(given: str, spelt: str) -> None:
    assert checked_domain(given) == spelt


@pytest.mark.parametrize(
    ("given", "said"),
    [
        ("ember.test:9511", r"has a port: give the host name alone \('ember.test'\)"),
        ("ember.test:", r"has a port"),
        ("https://ember.test", r"is not a host name: give the name alone"),
        ("ember.test/x", r"is not a host name"),
        ("127.0.0.1", r"is an IP address"),
        ("[::1]", r"is an IP address"),
        ("*.ember.test", r"is a wildcard: give the domain itself \('ember.test'\)"),
        ("straße.test", r"give its A-label"),
        ("ember_x.test", r"is not a host name: dot-separated labels"),
        ("-ember.test", r"is not a host name"),
        ("ember..test", r"is not a host name"),
        ("a" * 64 + ".test", r"is not a host name"),
        ("", r"is not a host name"),
        ("1.2.3", r"is not a host name"),
    ],
)
def test_a_domain_no_host_can_have_is_refused_saying_why(given: str, said: str) -> None:
    with pytest.raises(InvalidError, match=said):
        checked_domain(given)


def test_an_internationalised_domain_routes_the_a_label_hosts_send() -> None:
    # Clients send the A-label; the Unicode spelling of the setting used to never match.
    host = "app--ep.xn--bcher-kva.test:9511"
    assert route_request(host, "/m", "bücher.test") == Route("app--ep", "m", True)
    assert route_request(host, "/m", "xn--bcher-kva.test") == Route("app--ep", "m", True)


def test_urls_spell_the_domain_as_hosts_do() -> None:
    base = "https://127.0.0.1:8443"
    assert endpoint_urls("app--ep", base, "Ember.Test")[0] == "https://app--ep.ember.test:8443/"
    assert endpoint_urls("app--ep", base, "bücher.test")[0] == (
        "https://app--ep.xn--bcher-kva.test:8443/"
    )
