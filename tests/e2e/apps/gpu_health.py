"""An endpoint on one of a worker's declared GPUs, which says which it is shown
(CUDA_VISIBLE_DEVICES): nothing here touches CUDA."""

import os

import ember


@ember.endpoint(gpu="H100", min_replicas=1, max_replicas=1, snapshot=False)
def held() -> str | None:
    return os.environ.get("CUDA_VISIBLE_DEVICES")
