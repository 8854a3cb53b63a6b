"""infra/k8s/: the base and each overlay render (infra/k8s/render.py), validate against
Kubernetes' published schemas (kubernetes-validate, which bundles them: no network), and
keep our own rules: one control-plane replica today and three in the overlay for later,
probes on the server's health route, the worker's token and the database's URL from
Secrets, pinned image tags, and arguments the real `ember` command accepts.
tests/e2e/test_k8s_probes.py starts a server with the manifest's arguments."""

from __future__ import annotations

import copy
import re
import tomllib
from pathlib import Path
from typing import Any

import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import yaml  # type: ignore[import-untyped]
from k8s_manifests import (
    CONTROL_PLANE,
    K8S,
    KUSTOMIZATIONS,
    ROOT,
    WORKER,
    Resource,
    expanded_args,
    find,
    only_container,
    option,
    pod_spec,
    render,
    renderer,
    settings,
)

from ember.cli.main import build_parser

# The oldest Kubernetes we claim, and the newest the validator knows.
VERSIONS = ("1.29", kubernetes_validate.latest_version())
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
HEALTH = "/v1/health"  # the route tests/e2e/test_k8s_probes.py checks on a real server


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[Resource]]:
    return {name: render(name) for name in KUSTOMIZATIONS}


def test_every_kustomization_validates_against_kubernetes_schemas(
    rendered: dict[str, list[Resource]],
) -> None:
    for name, resources in rendered.items():
        kinds = sorted({r["kind"] for r in resources})
        assert kinds == sorted(
            {"ConfigMap", "DaemonSet", "Deployment", "Ingress", "Namespace",
             "PersistentVolumeClaim", "PodDisruptionBudget", "Service"}
        ), name  # fmt: skip
        for resource in resources:
            for version in VERSIONS:
                # strict: a field the schema does not have (a misspelling) fails too
                kubernetes_validate.validate(resource, version, strict=True)


def test_the_validator_refuses_a_misspelt_or_mistyped_field(
    rendered: dict[str, list[Resource]],
) -> None:
    deployment = copy.deepcopy(find(rendered["base"], "Deployment", CONTROL_PLANE))
    deployment["spec"]["replica"] = 3
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, VERSIONS[0], strict=True)
    deployment = copy.deepcopy(find(rendered["base"], "Deployment", CONTROL_PLANE))
    only_container(deployment)  # one container
    pod_spec(deployment)["containers"][0]["ports"][0]["containerPort"] = "8443"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, VERSIONS[0], strict=True)


def test_one_control_plane_process_in_the_base_and_three_in_the_overlay(
    rendered: dict[str, list[Resource]],
) -> None:
    for name, replicas, strategy in (
        ("base", 1, "Recreate"),
        ("postgresql", 1, "Recreate"),
        ("three-replicas", 3, "RollingUpdate"),
    ):
        deployment = find(rendered[name], "Deployment", CONTROL_PLANE)
        assert deployment["spec"]["replicas"] == replicas, name
        assert deployment["spec"]["strategy"]["type"] == strategy, name
        budget = find(rendered[name], "PodDisruptionBudget", CONTROL_PLANE)
        assert budget["spec"] == {
            "maxUnavailable": 1,
            "selector": {"matchLabels": deployment["spec"]["template"]["metadata"]["labels"]},
        }
    # Several processes share no volume: each its own state dir, the state in PostgreSQL.
    three = pod_spec(find(rendered["three-replicas"], "Deployment", CONTROL_PLANE))
    assert three["volumes"][0] == {"name": "state", "emptyDir": {}}
    # Each holds the files all share (the CA, the certificate, the admin token, the webhook
    # secret) and says where the others reach it when it owns the platform.
    assert {"name": "shared-files", "secret": {"secretName": "ember-control-plane-files",
            "defaultMode": 0o400}} in three["volumes"]  # fmt: skip
    [copy] = three["initContainers"]
    assert copy["image"] == three["containers"][0]["image"]
    assert "/var/lib/ember/" in copy["args"][0]
    resources = rendered["three-replicas"]
    args = expanded_args(only_container(find(resources, "Deployment", CONTROL_PLANE)), resources)
    assert option(args, "--advertise-url") == "https://<POD_IP>:8443"
    assert option(args, "--state-dir") == "/var/lib/ember"
    assert (
        "NOT FOR TODAY" not in (KUSTOMIZATIONS["three-replicas"] / "kustomization.yaml").read_text()
    )


def test_probes_ask_the_health_route_on_the_serving_port(
    rendered: dict[str, list[Resource]],
) -> None:
    for resources in rendered.values():
        container = only_container(find(resources, "Deployment", CONTROL_PLANE))
        [port] = container["ports"]
        args = expanded_args(container, resources)
        assert str(port["containerPort"]) == option(args, "--port")
        assert option(args, "--host") == "0.0.0.0"
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert container[probe]["httpGet"] == {
                "path": HEALTH,
                "port": port["name"],
                "scheme": "HTTPS",
            }
        service = find(resources, "Service", CONTROL_PLANE)
        assert service["spec"]["ports"][0]["targetPort"] == port["name"]
        pod_labels = find(resources, "Deployment", CONTROL_PLANE)["spec"]["template"]
        assert service["spec"]["selector"] == pod_labels["metadata"]["labels"]


def test_arguments_are_ones_the_ember_command_takes(rendered: dict[str, list[Resource]]) -> None:
    parser = build_parser()
    for name, resources in rendered.items():
        server = only_container(find(resources, "Deployment", CONTROL_PLANE))
        args = parser.parse_args(expanded_args(server, resources))  # SystemExit if not
        domain = settings(resources)["EMBER_DOMAIN"]
        assert (args.command, args.no_worker, args.domain) == ("server", True, domain), name
        assert args.public_url == f"https://{domain}"
        worker = only_container(find(resources, "DaemonSet", WORKER))
        args = parser.parse_args(expanded_args(worker, resources))
        assert (args.command, args.server) == ("worker", f"https://{domain}"), name
        assert server["command"] == worker["command"] == ["/opt/ember/.venv/bin/ember"]
    server = only_container(find(rendered["postgresql"], "Deployment", CONTROL_PLANE))
    args = parser.parse_args(expanded_args(server, rendered["postgresql"]))
    assert args.blob_store == settings(rendered["postgresql"])["EMBER_BLOB_STORE"]


def _secret_from(container: dict[str, Any], variable: str) -> dict[str, str]:
    [entry] = [e for e in container.get("env", []) if e["name"] == variable]
    assert "value" not in entry, f"{variable} written into the manifest"
    return dict(entry["valueFrom"]["secretKeyRef"])


def test_the_worker_token_and_the_database_url_come_from_secrets(
    rendered: dict[str, list[Resource]],
) -> None:
    for resources in rendered.values():
        worker = only_container(find(resources, "DaemonSet", WORKER))
        assert _secret_from(worker, "EMBER_WORKER_TOKEN") == {
            "name": "ember-worker-token",
            "key": "token",
        }
        assert not [a for a in worker["args"] if "token" in a.lower()]  # never in `ps`
        assert "command" not in str(worker["command"][1:])
    server = only_container(find(rendered["postgresql"], "Deployment", CONTROL_PLANE))
    assert _secret_from(server, "EMBER_DATABASE_URL") == {"name": "ember-database", "key": "url"}
    assert {"secretRef": {"name": "ember-s3"}} in server["envFrom"]
    text = renderer().to_yaml(rendered["three-replicas"])
    assert "postgresql://" not in text and "AWS_SECRET_ACCESS_KEY:" not in text
    assert "kind: Secret" not in text  # the operator makes them (docs/operations.md)


def test_the_worker_is_privileged_with_node_caches_and_gpus(
    rendered: dict[str, list[Resource]],
) -> None:
    for resources in rendered.values():
        daemon_set = find(resources, "DaemonSet", WORKER)
        worker = only_container(daemon_set)
        assert worker["securityContext"] == {"privileged": True}  # CRIU
        assert worker["resources"]["limits"]["nvidia.com/gpu"] >= 1  # NVIDIA's device plugin
        work_dir = option(expanded_args(worker, resources), "--work-dir")
        [mount] = [m for m in worker["volumeMounts"] if m["mountPath"] == work_dir]
        [volume] = [v for v in pod_spec(daemon_set)["volumes"] if v["name"] == mount["name"]]
        assert volume["hostPath"] == {"path": work_dir, "type": "DirectoryOrCreate"}
        env = {e["name"]: e for e in worker["env"]}
        assert env["NODE_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}


def test_the_ingress_serves_the_domain_and_its_wildcard_with_cert_manager_tls(
    rendered: dict[str, list[Resource]],
) -> None:
    for resources in rendered.values():
        ingress = find(resources, "Ingress", "ember")
        domain = settings(resources)["EMBER_DOMAIN"]
        hosts = [domain, f"*.{domain}"]
        assert [rule["host"] for rule in ingress["spec"]["rules"]] == hosts
        assert ingress["spec"]["tls"] == [{"hosts": hosts, "secretName": "ember-tls"}]
        assert "cert-manager.io/cluster-issuer" in ingress["metadata"]["annotations"]
        service = find(resources, "Service", CONTROL_PLANE)
        for rule in ingress["spec"]["rules"]:
            [path] = rule["http"]["paths"]
            backend = path["backend"]["service"]
            assert backend == {"name": CONTROL_PLANE, "port": {"name": "https"}}
            assert backend["port"]["name"] in [p["name"] for p in service["spec"]["ports"]]


def test_images_are_pinned_to_this_version(rendered: dict[str, list[Resource]]) -> None:
    split_image = renderer().split_image
    for resources in rendered.values():
        for resource in resources:
            if "template" not in resource.get("spec", {}):
                continue
            for container in pod_spec(resource)["containers"]:
                name, tag = split_image(container["image"])
                assert tag == VERSION, container["image"]  # never untagged or `latest`
    for file in sorted(K8S.glob("*.Containerfile")):
        text = file.read_text()
        [base] = re.findall(r"^ARG DEBIAN_IMAGE=(\S+)$", text, re.MULTILINE)
        name, tag = split_image(base)
        assert name.endswith("/debian") and re.fullmatch(r"\d+\.\d+-slim", tag), base
        assert 'ENTRYPOINT ["/opt/ember/.venv/bin/ember"]' in text
        for source in re.findall(r"^COPY (\S+) ", text, re.MULTILINE):
            assert (ROOT / source).exists(), source
    worker = (K8S / "worker.Containerfile").read_text()
    assert "bash infra/install.sh && test -x /usr/local/sbin/criu" in worker
    assert "bash infra/criu.sh" in (ROOT / "infra" / "install.sh").read_text()
    assert (
        "EMBER_CRIU=skip bash infra/install.sh" in (K8S / "control-plane.Containerfile").read_text()
    )


def test_the_renderer_applies_json_patches_and_images(tmp_path: Path) -> None:
    render_module = renderer()
    (tmp_path / "base").mkdir()
    pod: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "p", "labels": {"a/b": "1"}},
        "spec": {"containers": [{"name": "c", "image": "reg:5000/x/y:1", "args": ["a"]}]},
    }
    (tmp_path / "base" / "pod.yaml").write_text(yaml.safe_dump(pod))
    (tmp_path / "base" / "kustomization.yaml").write_text("resources: [pod.yaml]\n")
    operations = [
        {"op": "add", "path": "/spec/containers/0/args/-", "value": "b"},
        {"op": "add", "path": "/spec/containers/0/args/0", "value": "first"},
        {"op": "replace", "path": "/metadata/labels/a~1b", "value": "2"},
        {"op": "remove", "path": "/spec/containers/0/args/1"},
    ]
    overlay = {
        "resources": ["base"],
        "patches": [{"target": {"kind": "Pod", "name": "p"}, "patch": yaml.safe_dump(operations)}],
        "images": [{"name": "reg:5000/x/y", "newName": "r.example/y", "newTag": "2"}],
    }
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump(overlay))
    [done] = render_module.render(tmp_path)
    assert done["spec"]["containers"][0]["args"] == ["first", "b"]
    assert done["metadata"]["labels"] == {"a/b": "2"}
    assert done["spec"]["containers"][0]["image"] == "r.example/y:2"
    assert pod["spec"]["containers"][0]["args"] == ["a"]  # values copied, never shared
    for refused, said in (
        ({"resources": ["base"], "namePrefix": "x-"}, "namePrefix not rendered here"),
        ({"resources": ["nowhere.yaml"]}, "resource nowhere.yaml is not there"),
        (
            {"resources": ["base"], "patches": [{"target": {"kind": "Pod", "name": "q"},
                                                  "patch": "[]"}]},
            "no resource is the target",
        ),
        (
            {"resources": ["base"], "patches": [{"target": {"kind": "Pod"},
                                                  "patch": "metadata: {name: p}"}]},
            "only JSON 6902 patches",
        ),
        (
            {"resources": ["base"], "patches": [{"target": {"kind": "Pod"}, "patch": yaml.safe_dump(
                [{"op": "replace", "path": "/spec/nothing", "value": 1}])}]},
            "replace /spec/nothing on Pod/p",
        ),
    ):  # fmt: skip
        (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump(refused))
        with pytest.raises(render_module.RenderError, match=re.escape(said)):
            render_module.render(tmp_path)


def test_the_renderer_prints_a_stream_kubectl_applies(capsys: pytest.CaptureFixture[str]) -> None:
    assert renderer().main([str(KUSTOMIZATIONS["postgresql"])]) == 0
    printed = [doc for doc in yaml.safe_load_all(capsys.readouterr().out) if doc]
    assert printed == render("postgresql")
    assert renderer().main([str(K8S)]) == 1  # no kustomization.yaml there
    assert "holds no kustomization.yaml" in capsys.readouterr().err
