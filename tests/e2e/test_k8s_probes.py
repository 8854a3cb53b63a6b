"""The control plane of infra/k8s/ started as its Deployment starts it (the manifest's own
arguments, on loopback and a free port): the kubelet's probes get 200 from the route they
ask, without a token and without checking the certificate, as the kubelet does; and the
Ingress's hosts reach the API (the domain) and the endpoints (its wildcard)."""

from __future__ import annotations

from pathlib import Path

import httpx
from harness import running_platform
from k8s_manifests import CONTROL_PLANE, expanded_args, find, only_container, render, settings


def _local(args: list[str]) -> tuple[str, ...]:
    """The server's arguments, less `server` and the state dir and port the harness gives,
    listening on loopback."""
    out: list[str] = []
    rest = iter(args[1:])
    for arg in rest:
        if arg in ("--state-dir", "--port"):
            next(rest)
        elif arg == "--host":
            out += [arg, "127.0.0.1"]
            next(rest)
        else:
            out.append(arg)
    return tuple(out)


def test_the_probes_and_the_ingress_hosts_reach_a_server_run_as_the_manifest_says(
    tmp_path: Path,
) -> None:
    resources = render("base")
    container = only_container(find(resources, "Deployment", CONTROL_PLANE))
    probes = {container[p]["httpGet"]["path"] for p in container if p.endswith("Probe")}
    assert probes  # the unit test checks there are three, and on which port
    domain = settings(resources)["EMBER_DOMAIN"]
    extra = _local(expanded_args(container, resources))
    with running_platform(tmp_path, extra=extra) as platform:
        address = platform.url.removeprefix("https://")
        with httpx.Client(base_url=platform.url, verify=False, timeout=30) as kubelet:
            for path in sorted(probes):
                headers = {"Host": address, "User-Agent": "kube-probe/1.31"}
                answer = kubelet.get(path, headers=headers)
                assert answer.status_code == 200, (path, answer.text)
            # What the Ingress passes on: the domain's Host is the API, a name under it an
            # endpoint (none deployed: a 404 that says so).
            answer = kubelet.get("/v1/health", headers={"Host": domain})
            assert answer.status_code == 200, answer.text
            answer = kubelet.get("/", headers={"Host": f"shop--predict.{domain}"})
            assert answer.status_code == 404 and "shop--predict" in answer.text, answer.text
