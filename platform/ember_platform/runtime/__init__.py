"""The control plane's live picture: endpoints with their queues, replicas, workers and
inputs as they are now (cluster_model.py, live_state.py, inputs.py), below every part that
changes it (core, calls, images, snapshots). Nothing here knows HTTP.
"""
