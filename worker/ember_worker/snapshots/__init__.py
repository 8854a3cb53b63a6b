"""Process snapshots: CRIU images, the CUDA checkpoint API, and the files an image carries or maps."""
