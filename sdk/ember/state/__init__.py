"""State shared by an app's replicas and its clients: ember.Dict, ember.Queue and ember.Volume."""
