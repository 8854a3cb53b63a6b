"""What each workspace may hold of the platform at once: inputs queued and running, calls
a second, and bytes of bodies, results and stream events in the control plane."""
