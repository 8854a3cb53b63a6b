"""The worker agent: one per node; registers, heartbeats, and runs replicas on command."""
