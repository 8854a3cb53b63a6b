"""Endpoints that ask for nodes by their labels (node_labels=)."""

import os

import ember


@ember.endpoint(node_labels={"zone": "eu-west"}, snapshot=False)
def in_eu() -> str:
    return os.environ["EMBER_VOLUMES_DIR"]  # under the work dir of the node it runs on


@ember.endpoint(snapshot=False)
def anywhere() -> str:
    return os.environ["EMBER_VOLUMES_DIR"]


@ember.endpoint(node_labels={"zone": "mars"}, snapshot=False)
def on_mars() -> str:
    return "never"
