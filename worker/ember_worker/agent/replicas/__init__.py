"""The replicas this node runs: launched (restored or cold), given their environment,
GPUs and cgroups, stopped, and reported when they exit."""
