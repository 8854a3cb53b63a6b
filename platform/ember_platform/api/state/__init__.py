"""The `/v1/apps/{app}/...` resources of apps' shared state: `ember.Dict` and
`ember.Queue` (`shared_state.py`) and `ember.Volume` (`volumes.py`)."""
