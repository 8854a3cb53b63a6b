"""Snapshots on the control plane's side: which replica takes an image, which ones restore from it,
and what workers report.
"""
