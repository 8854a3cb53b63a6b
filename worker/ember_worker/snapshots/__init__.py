"""Process snapshots: CRIU images taken, shared, fetched and restored (`snapshotter`), the
CUDA checkpoint API, and the files an image carries or maps."""
