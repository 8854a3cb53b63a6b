"""A private registry image belongs to the workspace whose credentials pulled it (issue
47): another workspace that declares the same image reuses nothing of it until the
registry has accepted that workspace's own credentials for the same manifest.

The attack as reported: workspace alpha pulled an image from a registry that wants a
password, with its secret `regcred`; workspace bravo declared the same
`from_registry(reference, secret="regcred")` with a `regcred` of its own holding a wrong
password. Its build said `(built already)`, skipping the pull that would have refused
it, and its endpoint served alpha's private file. Here, against a real `ember server`
and a real registry with htpasswd: bravo's deploy fails naming the registry's refusal
(with the wrong password, and with no secret at all), a deployment that skips the build
is refused as of an image not built, bravo's build API says the image is not built and
its token lists no images; with the right password, bravo's build checks it with the
registry and reuses the pulled layer, and its endpoint serves."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
from harness import EMBER, Platform, running_platform
from machine_needs import need
from oci_registry import check_tools, push_layers, running_registry
from small_images import E, host_python_layer, layer_tar

import ember
from ember.calling.tlsclient import client_context

USER = ("ann", "the-right-password")
PRIVATE = "alpha's private file, from a registry that wants a password\n"
ALPHA, BRAVO = "alpha", "bravo"

APP = """
import ember

image = ember.Image.from_registry("{reference}"{secret})


@ember.endpoint(image=image)
def read() -> str:
    return open("/private.txt").read()
"""

# `ember deploy` without its build step: the deployment names the image's digest as is.
DEPLOY_SKIPPING_THE_BUILD = (
    "import sys\n"
    "import ember.cli.apps.deploy as deploy\n"
    "from ember.cli.main import main\n"
    "deploy.build_images = lambda client, manifest: None\n"
    "sys.exit(main())\n"
)


def cli(platform: Platform, token: str, *args: str, command: list[str] | None = None) -> Any:
    env = {**platform.env, "EMBER_TOKEN": token, "EMBER_SERVER_URL": platform.url}
    env["EMBER_CA_CERT"] = platform.ca
    env.pop("EMBER_WORKSPACE", None)
    return subprocess.run(
        [*(command or EMBER), *args], env=env, capture_output=True, text=True, timeout=300
    )


def client(platform: Platform, token: str) -> httpx.Client:
    return httpx.Client(
        base_url=platform.url,
        verify=client_context(platform.ca),
        headers={"Authorization": f"Bearer {token}"},
        timeout=120,
    )


def app_file(folder: Path, reference: str, secret: str | None) -> Path:
    source = folder / "vault" / "app.py"
    source.parent.mkdir(parents=True)
    named = "" if secret is None else f", secret={secret!r}"
    source.write_text(APP.format(reference=reference, secret=named))
    return source


def test_another_workspace_reuses_a_private_image_only_with_credentials_the_registry_takes(
    tmp_path: Path,
) -> None:
    if os.geteuid() != 0:
        need("root", "replicas on an image run in a sandbox, which root builds")
    check_tools()
    tars = tmp_path / "tars"
    layers = [
        tars / host_python_layer(tars),  # python3.11 to run the endpoint with
        tars / layer_tar(tars, [E("f", "private.txt", PRIVATE.encode())]),
    ]
    with (
        running_registry(tmp_path / "registry", USER) as registry,
        running_platform(tmp_path / "platform") as platform,
    ):
        reference = f"{registry}/team/private:v1"
        manifest = push_layers(registry, "team/private", "v1", layers, USER)
        digest = ember.Image.from_registry(reference, secret="regcred").digest
        tokens = {}
        for workspace in (ALPHA, BRAVO):
            platform.ember("workspace", "create", workspace)
            tokens[workspace] = platform.ember(
                "token", "create", "--workspace", workspace, "--scope", "deploy"
            ).stdout.strip()
        alpha, bravo = tokens[ALPHA], tokens[BRAVO]
        right = (f"REGISTRY_USERNAME={USER[0]}", f"REGISTRY_PASSWORD={USER[1]}")
        wrong = (f"REGISTRY_USERNAME={USER[0]}", "REGISTRY_PASSWORD=a-guess")
        assert cli(platform, alpha, "secret", "set", "regcred", *right).returncode == 0
        assert cli(platform, bravo, "secret", "set", "regcred", *wrong).returncode == 0
        source = app_file(tmp_path / "with-secret", reference, "regcred")

        # alpha pulls its image with its credentials and serves its file.
        pulled = cli(platform, alpha, "deploy", str(source), "--wait")
        assert pulled.returncode == 0, pulled.stderr
        assert f"[1/1] from_registry: {reference}" in pulled.stderr
        with client(platform, alpha) as caller:
            assert caller.post(f"/{ALPHA}--vault--read/", json={}).json() == PRIVATE

        # bravo, the same declaration and a wrong password: the registry's refusal.
        refused = cli(platform, bravo, "deploy", str(source), "--wait")
        said = refused.stdout + refused.stderr
        assert refused.returncode == 1, said
        assert "built already" not in said, said
        assert "the registry refused the credentials" in said, said
        assert "regcred" in said and PRIVATE.strip() not in said
        with client(platform, bravo) as caller:
            assert caller.post(f"/{BRAVO}--vault--read/", json={}).status_code == 404

        # Nor without a secret (the secret's name is not in the digest).
        bare = app_file(tmp_path / "no-secret", reference, None)
        assert ember.Image.from_registry(reference).digest == digest
        anonymous = cli(platform, bravo, "deploy", str(bare))
        assert anonymous.returncode == 1, anonymous.stderr
        assert "wants a username and password" in anonymous.stderr, anonymous.stderr

        # Nor by skipping the build: the deployment is refused as of an image not built.
        skipped = cli(
            platform,
            bravo,
            "deploy",
            str(source),
            command=[sys.executable, "-c", DEPLOY_SKIPPING_THE_BUILD],
        )
        assert skipped.returncode == 1, skipped.stdout + skipped.stderr
        assert f"image {digest[7:19]} is not built" in skipped.stderr, skipped.stderr

        # Its build API and image listing show bravo nothing of alpha's.
        with client(platform, bravo) as caller:
            assert caller.get(f"/v1/image-builds/{digest}").json() == {"built": False}
        with client(platform, alpha) as caller:
            assert caller.get(f"/v1/image-builds/{digest}").json() == {"built": True}
        listing = cli(platform, bravo, "image", "ls")
        assert listing.returncode == 1 and digest[7:19] not in listing.stdout

        # With the right password, the registry accepts bravo for the manifest alpha
        # pulled: bravo reuses the layer and serves the same file, as it may.
        assert cli(platform, bravo, "secret", "set", "regcred", *right).returncode == 0
        accepted = cli(platform, bravo, "deploy", str(source), "--wait")
        assert accepted.returncode == 0, accepted.stderr
        assert f"the registry accepted this workspace's credentials for {manifest}" in (
            accepted.stderr
        )
        with client(platform, bravo) as caller:
            assert caller.post(f"/{BRAVO}--vault--read/", json={}).json() == PRIVATE
