"""`@ember.endpoint` and the lifecycle markers of class endpoints."""

from __future__ import annotations

import dataclasses
import inspect
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar, cast

from ember.config import ClientConfig
from ember.declarations.engine_metrics import MetricTarget
from ember.declarations.parameters import parameter_kinds
from ember.declarations.retries import Retries
from ember.declarations.schedules import Cron, Period
from ember.declarations.settings import EndpointSettings, check_name, normalize_name
from ember.endpoints.asgi import is_asgi_factory, is_wsgi_factory
from ember.endpoints.batching import batch_settings
from ember.endpoints.health import HealthCheck, health_settings
from ember.endpoints.schemas import arguments_schema, result_schema, summary_and_description
from ember.errors import InvalidError
from ember.images.image import Image
from ember.wire.labels import current_app
from ember.wire.spec import FUNCTION_METHOD, EndpointSpec, MethodSpec, check_gang_inputs

if TYPE_CHECKING:
    from ember.calling.client import Endpoint

F = TypeVar("F", bound=Callable[..., Any])

# Attribute names the markers set on functions inside a class endpoint.
ENTER_ATTR = "__ember_enter__"  # value: {"snap": bool}
METHOD_ATTR = "__ember_method__"  # {"path", "stream_flag", "affinity_field", "stream_done"}
EXIT_ATTR = "__ember_exit__"


def _is_generator(func: Callable[..., Any]) -> bool:
    return inspect.isgeneratorfunction(func) or inspect.isasyncgenfunction(func)


# One URL path segment: unreserved characters of RFC 3986, not "." or "..".
PATH_SEGMENT = re.compile(r"[A-Za-z0-9._~-]+\Z")
MAX_PATH_SEGMENTS = 8


def _method_options(func: Callable[..., Any]) -> dict[str, Any]:
    """What `@ember.method(...)` recorded on `func` (a bound method reads its function's)."""
    options = getattr(func, METHOD_ATTR, None)
    return options if isinstance(options, dict) else {}


def _method_spec(name: str, func: Callable[..., Any]) -> MethodSpec:
    options = _method_options(func)
    return MethodSpec(
        name=name,
        streaming=_is_generator(func),
        is_async=inspect.iscoroutinefunction(func) or inspect.isasyncgenfunction(func),
        path=options.get("path"),
        stream_flag=options.get("stream_flag"),
        affinity_field=options.get("affinity_field"),
        stream_done=options.get("stream_done") is True,
        # A batched method's hints describe lists of what each caller sends.
        parameters={} if batch_settings(func) is not None else parameter_kinds(func),
    )


def _documented(spec: MethodSpec, func: Callable[..., Any], takes_instance: bool) -> MethodSpec:
    """`spec` with its OpenAPI document's schemas and docstring (`ember.endpoints.schemas`)."""
    batched = batch_settings(func) is not None
    summary, description = summary_and_description(func)
    return dataclasses.replace(
        spec,
        arguments_schema=arguments_schema(func, batched=batched, takes_instance=takes_instance),
        result_schema=result_schema(func, batched=batched),
        summary=summary,
        description=description,
    )


def stream_flag(func: Callable[..., Any]) -> str | None:
    """The argument that decides per call whether `func`, a method, streams; None if none."""
    return _method_options(func).get("stream_flag")


def _check_path(path: object) -> str:
    if not isinstance(path, str):
        raise InvalidError(f"@ember.method(path=...) takes a string, not {path!r}")
    segments = path.strip("/").split("/")
    if not 1 <= len(segments) <= MAX_PATH_SEGMENTS or not all(
        PATH_SEGMENT.match(s) and s not in (".", "..") for s in segments
    ):
        raise InvalidError(
            f"@ember.method(path={path!r}): a path is 1 to {MAX_PATH_SEGMENTS} segments of "
            'letters, digits and "._~-" separated by "/", such as "v1/chat/completions"'
        )
    return "/".join(segments)


def _check_argument_name(func: Callable[..., Any], option: str, name: object) -> str:
    """`name`, an argument of `func` (or one its **kwargs can take) named by `option`."""
    where = f"@ember.method({option}={name!r}) on {func.__qualname__}"
    if not isinstance(name, str) or not name.isidentifier():
        raise InvalidError(f"{where}: {option} is the name of an argument")
    parameters = inspect.signature(func).parameters
    if name not in parameters and not any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
        raise InvalidError(f"{where}: the method has no argument {name!r}")
    return name


def _check_stream_flag(func: Callable[..., Any], flag: object) -> str:
    if _is_generator(func):
        raise InvalidError(
            f"@ember.method(stream_flag={flag!r}) on {func.__qualname__}: the method decides "
            "per call, so it must return an iterator when the flag is true and a JSON value "
            "otherwise, not be a generator itself"
        )
    return _check_argument_name(func, "stream_flag", flag)


class EndpointDefinition:
    """What `@ember.endpoint(...)` returns: the user's function or class plus its settings.

    Calling it locally calls the function (or constructs the class), so the user's own
    tests keep working.
    """

    def __init__(self, target: Callable[..., Any] | type, settings: EndpointSettings) -> None:
        self.target = target
        self.settings = settings
        if inspect.isclass(target):
            self.kind = "class"
        else:
            self.kind = "asgi" if is_asgi_factory(target) else "function"
        self.name = settings.name or normalize_name(target.__name__)
        if not settings.name:
            try:
                check_name("endpoint", self.name)
            except InvalidError:
                raise InvalidError(
                    f"cannot derive an endpoint name from {target.__name__!r} "
                    f"(got {self.name!r}); pass name=... to @ember.endpoint"
                ) from None
        self.methods = self._collect_methods()
        self.enter_hooks, self.exit_hooks = self._collect_hooks()
        self.health_check = self._collect_health_check()
        self._check_batches()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.target(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<ember endpoint {self.name!r} ({self.kind})>"

    def deployed(self, app: str | None = None, *, config: ClientConfig | None = None) -> Endpoint:
        """This endpoint as deployed, to call it through the platform:
        `square.deployed().call(x=3)`. In a replica, `app` is the replica's own app and
        the platform's address and credentials come with the replica."""
        app = app or current_app()
        if app is None:
            raise InvalidError(f"{self.name}.deployed() needs app=... outside a replica of its app")
        # Here: the HTTP client is for the code that calls through the platform.
        from ember.calling.client import Endpoint

        return Endpoint.lookup(app, self.name, config=config)

    def spec(self, attribute: str) -> EndpointSpec:
        """What the platform is told at deploy time. Only then are the methods' schemas
        and docstrings read: a replica importing the code never needs them."""
        return EndpointSpec(
            name=self.name,
            attribute=attribute,
            kind=self.kind,
            settings=self.settings,
            methods={name: self._documented(method) for name, method in self.methods.items()},
        )

    def _documented(self, method: MethodSpec) -> MethodSpec:
        if self.kind == "asgi":
            return method  # the web app documents itself
        if self.kind == "function":
            return _documented(method, self.target, takes_instance=False)
        static = isinstance(inspect.getattr_static(self.target, method.name), staticmethod)
        return _documented(method, getattr(self.target, method.name), takes_instance=not static)

    def _collect_methods(self) -> dict[str, MethodSpec]:
        if self.kind == "asgi":
            _check_asgi_factory(self.target)
            # One streaming "method": a response is its start, then its body's chunks.
            return {FUNCTION_METHOD: MethodSpec(FUNCTION_METHOD, streaming=True, is_async=True)}
        if self.kind == "function":
            return {FUNCTION_METHOD: _method_spec(FUNCTION_METHOD, self.target)}
        cls = cast(type[Any], self.target)
        init = cls.__init__  # inherited too: replicas construct the class with no arguments
        if init is not object.__init__:
            required = [
                p.name
                for p in list(inspect.signature(init).parameters.values())[1:]
                if p.default is inspect.Parameter.empty
                and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
            ]
            if required:
                raise InvalidError(
                    f"class endpoint {cls.__name__} has an __init__ with required arguments "
                    f"{required}; replicas construct it with none. Move setup into a method "
                    "marked @ember.enter()"
                )
        methods = {
            name: _method_spec(name, func)
            for name, func in inspect.getmembers(cls, inspect.isfunction)
            if getattr(func, METHOD_ATTR, False)
        }
        if not methods:
            raise InvalidError(
                f"class endpoint {cls.__name__} has no methods to call; mark at least one "
                "with @ember.method"
            )
        taken: dict[str, str] = {}
        for spec in methods.values():
            if spec.path is None:
                continue
            other = taken.get(spec.path) or (spec.path if spec.path in methods else None)
            if other is not None:
                raise InvalidError(
                    f"class endpoint {cls.__name__}: path {spec.path!r} of {spec.name} is "
                    f"already the URL of {other}"
                )
            taken[spec.path] = spec.name
        return methods

    def _check_batches(self) -> None:
        """A batch is gathered from inputs running at once on one replica, so the
        endpoint's concurrency must let that many in."""
        functions = (
            [self.target]
            if self.kind != "class"
            else [getattr(self.target, name) for name in self.methods]
        )
        for func in functions:
            found = batch_settings(func)
            if found is not None and stream_flag(func) is not None:
                raise InvalidError(
                    f"{func.__qualname__}: @ember.batched and a stream flag do not mix; a "
                    "batch gathers plain calls"
                )
            if found is not None and found.max_batch_size > self.settings.concurrency:
                raise InvalidError(
                    f"{func.__qualname__} batches up to {found.max_batch_size} inputs but the "
                    f"endpoint's concurrency is {self.settings.concurrency}; set "
                    f"@ember.endpoint(concurrency={found.max_batch_size}) or more"
                )

    def _collect_health_check(self) -> tuple[str, HealthCheck] | None:
        """The class's `@ember.health_check` method (its name and settings), if any."""
        if self.kind != "class":
            if health_settings(self.target) is not None:
                raise InvalidError(
                    f"{self.target.__qualname__}: @ember.health_check goes on a method of a "
                    "class endpoint, whose replicas hold what it checks"
                )
            return None
        found = [
            (name, settings)
            for name, func in inspect.getmembers(self.target, inspect.isfunction)
            if (settings := health_settings(func)) is not None
        ]
        if len(found) > 1:
            names = ", ".join(name for name, _ in found)
            raise InvalidError(
                f"class endpoint {self.target.__name__} has several health checks ({names}); "
                "keep one that checks everything"
            )
        return found[0] if found else None

    def _collect_hooks(self) -> tuple[list[tuple[str, bool]], list[str]]:
        if self.kind != "class":
            return [], []
        members = inspect.getmembers(self.target, inspect.isfunction)
        # Snap hooks run first (before a snapshot would be taken), then the others.
        enters = [(n, getattr(f, ENTER_ATTR)["snap"]) for n, f in members if hasattr(f, ENTER_ATTR)]
        enters.sort(key=lambda item: not item[1])
        exits = [n for n, f in members if getattr(f, EXIT_ATTR, False)]
        return enters, exits


def endpoint(
    _target: Any = None,
    *,
    name: str | None = None,
    min_replicas: int = EndpointSettings.min_replicas,
    max_replicas: int = EndpointSettings.max_replicas,
    concurrency: int = EndpointSettings.concurrency,
    target_concurrency: int | None = None,
    scaledown_window: float = EndpointSettings.scaledown_window,
    buffer_replicas: int = EndpointSettings.buffer_replicas,
    timeout: float = EndpointSettings.timeout,
    retries: int | Retries = EndpointSettings.retries,
    gpu: str | list[str] | None = None,
    cpu: float = EndpointSettings.cpu,
    memory: int = EndpointSettings.memory,
    memory_limit: int | None = None,
    cpu_limit: float | None = None,
    public: bool = EndpointSettings.public,
    snapshot: bool = EndpointSettings.snapshot,
    weights: dict[str, str] | None = None,
    secrets: list[str] | None = None,
    s3_endpoint_url: str | None = None,
    schedule: Cron | Period | None = None,
    cors_origins: list[str] | None = None,
    env: dict[str, str] | None = None,
    max_body_mb: float | None = None,
    max_queue: int | None = None,
    queue_timeout: float | None = None,
    max_inputs: int | None = None,
    startup_timeout: float | None = None,
    node_labels: dict[str, str] | None = None,
    requirements: list[str] | None = None,
    rollout: str = EndpointSettings.rollout,
    engine_metrics: str | None = None,
    scale_on: MetricTarget | None = None,
    image: Image | None = None,
    log_rate: int | None = None,
    route_by: str | None = None,
    spread: bool = EndpointSettings.spread,
    nodes: int = EndpointSettings.nodes,
    gang_ports: int = EndpointSettings.gang_ports,
    gang_inputs: str = EndpointSettings.gang_inputs,
) -> Callable[[Callable[..., Any] | type], EndpointDefinition]:
    """Turn a function or a class into an endpoint served by Ember.

    `concurrency` is how many inputs one replica runs at once; `target_concurrency` (at
    most `concurrency`) is how many the autoscaler sizes for, so that a replica takes up
    to `concurrency` only while the new ones it asked for start; `scaledown_window` is how
    many seconds an idle replica lives on; `buffer_replicas` idle replicas are kept ready
    beyond what the inputs need while there are any (within `max_replicas`); `timeout`
    bounds one input; `retries` is how often an input is requeued when its replica is
    lost; `retries=ember.Retries(max_retries=3, initial_delay=1.0)` also retries inputs
    whose code raised, after a delay that grows by `backoff_coefficient` each time (a
    stream that has sent events is not retried). `gpu` is a type ("H100"), with a
    count ("H100:2"), or a list of them in order of preference. `cpu` and `memory` (MiB)
    are what the scheduler reserves on a node for each replica; `memory_limit` (MiB, at
    least `memory`) is a hard cap: a replica that goes over is ended by the OOM killer,
    and its callers are told so (unset, a replica may use what the node has); `cpu_limit`
    (CPUs, at least `cpu`) caps its CPU time likewise: past it, it waits for the next
    100 ms period (unset, it may use idle CPUs beyond `cpu`). `weights`
    names safetensors files (or sharded checkpoints: a URL ending in "/") that a class
    endpoint reads lazily as `self.weights[name]`; `s3_endpoint_url` points s3:// URLs at an S3 API
    other than AWS's (credentials come from the usual AWS settings of the worker).
    `secrets` names secrets made with `ember secret set NAME KEY=VALUE`: their variables
    are in every replica's environment, `enter(snap=True)` hooks included. `schedule`
    (`ember.Cron("0 * * * *")` or `ember.Period(minutes=5)`) has the platform call a
    function endpoint that takes no arguments at those times, as a spawned call.
    `cors_origins` lists the web pages ("https://app.example.com", or "*") whose scripts
    may call it from a browser; a web app (`@ember.asgi_app()`) answers CORS itself.
    `env` sets environment variables in every replica (before `enter(snap=True)` too);
    a secret's variables win over them. `max_body_mb` raises (or lowers) the server's
    limit on a request's body for this endpoint, up to 48 MiB: for uploads. `max_queue`
    is how many inputs may wait for a replica before callers get 429 (the server's
    `--max-queue` by default); `queue_timeout` sheds load: a synchronous call that waits
    that many seconds for a free replica gets 504 instead of waiting on (spawned calls
    wait as long as it takes). `max_inputs` retires a replica once it was handed that
    many inputs (retries count): a fresh one, restored from the snapshot, takes the next
    ones (`max_inputs=1`: a new process for every input). `startup_timeout` is how many
    seconds a replica may take to be ready (its boot or restore and `enter` hooks: raise
    it for models that load for longer than 10 minutes) before it counts as a failed
    start. `node_labels={"zone": "eu-west"}` keeps the replicas on worker nodes that
    carry all of these labels (`ember worker --label zone=eu-west`). `requirements`
    lists pip requirement lines ("vllm==0.11.0", "./wheels/kernels.whl": paths are the
    app folder's) for this endpoint's replicas, installed once per node with the app's
    `requirements.txt` into an environment of their own. `rollout` is how a
    redeploy replaces replicas: "rolling" (the old version serves until the new one's
    replicas are ready, or on if they fail to start) or "recreate" (the old replicas
    drain at once; calls wait for the new). `engine_metrics` names where the replicas'
    engine keeps Prometheus metrics: "prometheus" (the replica process's own
    prometheus_client registry, where an in-process engine such as vLLM's AsyncLLM
    registers its `vllm:*` metrics) or a URL on the replica's loopback
    ("http://127.0.0.1:8000/metrics", for an engine that serves them itself); each
    replica scrapes them every 2 s and Ember's `/metrics` exports them under their own
    names with app, endpoint and replica labels. `scale_on=ember.MetricTarget(name,
    per_replica=X)` (with `engine_metrics`) also sizes the endpoint on one of them: as
    many replicas as keep its sum over the replicas near X each (the larger of that and
    what the queue asks for); without fresh values, the queue alone decides.
    `image=ember.Image.debian_slim().apt_install(...)` declares the root file system
    its replicas are to run on (docs/images.md: workers build it; replicas cannot run
    on it yet, so such a deploy is refused for now). `log_rate` (KiB a second) lowers
    how much of each replica's output its log keeps (`ember logs`): past it (and a burst
    of ten seconds of it), lines are dropped and a line says how many; the node's limit
    (`ember worker --log-rate`, 1024 by default) caps it. `route_by="prefix"`, for LLM
    engines with a prefix cache: a request (an OpenAI request's `messages`, or a
    `prompt`) goes to the replica that served the longest prefix of it lately, unless
    that replica is busy (`target_concurrency` inputs or more), then to the least busy;
    a prompt no replica served is placed as any call; an affinity key still wins
    (docs/llm.md). Replicas spread over zones (the nodes' `zone` label) and nodes, so
    that losing one leaves the others serving; `spread=False` packs them onto the fewest.
    `nodes=2` makes each replica a gang: a process on each of 2 nodes (each with the
    `gpu`, `cpu` and `memory` asked), placed together or not at all, with torchrun's
    variables (`RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`...); rank 0 takes the
    inputs (`gang_inputs="every_rank"`: every member runs each input, rank 0's result is
    the answer, and a member's error is the call's), and any member's end ends the gang
    (docs/scaling.md). Each member may listen on `gang_ports` ports for its peers
    (`EMBER_GANG_PORTS`).
    """
    if schedule is not None and not isinstance(schedule, Cron | Period):
        raise InvalidError(
            f"schedule={schedule!r}: use ember.Cron('*/5 * * * *') or ember.Period(minutes=5)"
        )
    if scale_on is not None and not isinstance(scale_on, MetricTarget):
        raise InvalidError(
            f"scale_on={scale_on!r}: use ember.MetricTarget('vllm:num_requests_waiting', "
            "per_replica=4.0)"
        )
    if image is not None and not isinstance(image, Image):
        raise InvalidError(
            f"image={image!r}: use an ember.Image, e.g. "
            "ember.Image.debian_slim().apt_install('ffmpeg')"
        )
    if _target is not None:
        raise InvalidError(
            "@ember.endpoint needs parentheses: write @ember.endpoint() "
            "(or @ember.endpoint(max_replicas=4, ...)); did you forget them?"
        )
    settings = EndpointSettings(
        name=name,
        min_replicas=min_replicas,
        max_replicas=max_replicas,
        concurrency=concurrency,
        target_concurrency=target_concurrency,
        scaledown_window=scaledown_window,
        buffer_replicas=buffer_replicas,
        timeout=timeout,
        retries=retries.max_retries if isinstance(retries, Retries) else retries,
        retry_backoff=retries.backoff() if isinstance(retries, Retries) else None,
        gpu=gpu,
        cpu=cpu,
        memory=memory,
        memory_limit=memory_limit,
        cpu_limit=cpu_limit,
        public=public,
        snapshot=snapshot,
        weights=dict(weights)
        if isinstance(weights, dict)
        else ({} if weights is None else weights),
        secrets=list(secrets) if isinstance(secrets, list | tuple) else (secrets or []),
        s3_endpoint_url=s3_endpoint_url,
        schedule=None if schedule is None else schedule.to_dict(),
        cors_origins=list(cors_origins)
        if isinstance(cors_origins, list | tuple)
        else (cors_origins or []),
        env=dict(env) if isinstance(env, dict) else (env or {}),
        max_body_mb=max_body_mb,
        max_queue=max_queue,
        queue_timeout=queue_timeout,
        max_inputs=max_inputs,
        startup_timeout=startup_timeout,
        node_labels=dict(node_labels) if isinstance(node_labels, dict) else (node_labels or {}),
        requirements=list(requirements)
        if isinstance(requirements, list | tuple)
        else (requirements or []),
        rollout=rollout,
        engine_metrics=engine_metrics,
        scale_on=None if scale_on is None else scale_on.to_dict(),
        image=None if image is None else image.to_dict(),
        log_rate=log_rate,
        route_by=route_by,
        spread=spread,
        nodes=nodes,
        gang_ports=gang_ports,
        gang_inputs=gang_inputs,
    )

    def wrap(target: Callable[..., Any] | type) -> EndpointDefinition:
        if isinstance(target, EndpointDefinition):
            raise InvalidError(f"{target!r} is decorated with @ember.endpoint twice")
        if not (inspect.isclass(target) or inspect.isfunction(target)):
            raise InvalidError(
                f"@ember.endpoint(...) decorates a function or a class, not {target!r}"
            )
        if schedule is not None:
            _check_schedulable(target)
        definition = EndpointDefinition(target, settings)
        check_gang_inputs(definition.name, definition.kind, settings)
        if settings.cors_origins and definition.kind == "asgi":
            raise InvalidError(
                f"{definition.name}: a web app answers CORS itself (for example with "
                "Starlette's or FastAPI's CORSMiddleware); drop cors_origins"
            )
        return definition

    return wrap


def _check_called_bare(func: Callable[..., Any], role: str) -> None:
    """The platform calls `func` with no arguments (as `role`): none may be required."""
    required = [
        p.name
        for p in inspect.signature(func).parameters.values()
        if p.default is inspect.Parameter.empty
        and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    ]
    if required:
        raise InvalidError(
            f"{func.__qualname__}: {role} is called with no arguments, so "
            f"{', '.join(required)} needs a default"
        )


def _check_asgi_factory(func: Callable[..., Any]) -> None:
    marker = "@ember.wsgi_app()" if is_wsgi_factory(func) else "@ember.asgi_app()"
    if _is_generator(func):
        raise InvalidError(f"{func.__qualname__}: {marker} marks a function that returns an app")
    _check_called_bare(func, f"an {marker} function")


def _check_schedulable(target: Callable[..., Any] | type) -> None:
    """A scheduled endpoint is a function the platform can call with no arguments."""
    name = target.__qualname__
    if is_asgi_factory(target):
        raise InvalidError(f"{name}: a web app cannot have a schedule")
    if inspect.isclass(target):
        raise InvalidError(
            f"{name}: schedule= goes on a function endpoint; a class endpoint has several "
            "methods, and the platform would not know which to run"
        )
    if _is_generator(target):
        raise InvalidError(f"{name}: a scheduled endpoint returns a value; it cannot stream")
    _check_called_bare(target, "a scheduled endpoint")


def _check_hook(kind: str, func: Any) -> None:
    if not inspect.isfunction(func):
        raise InvalidError(f"@ember.{kind} decorates a method of a class endpoint, not {func!r}")
    if _is_generator(func):
        raise InvalidError(
            f"{func.__qualname__} is a generator, but @ember.{kind} hooks cannot stream; "
            "return normally (use yield only in @ember.method)"
        )


def enter(_func: Any = None, *, snap: bool = False) -> Callable[[F], F]:
    """Mark a method to run when a replica starts.

    `snap=True` hooks run once, before a snapshot is taken (imports, weights, compile);
    the others run after every start or restore (reseed, reconnect).
    """
    if _func is not None:
        raise InvalidError(
            "@ember.enter needs parentheses: write @ember.enter() or @ember.enter(snap=True)"
        )
    if not isinstance(snap, bool):
        raise InvalidError(f"@ember.enter(snap=...) takes True or False, not {snap!r}")

    def mark(func: F) -> F:
        _check_hook("enter", func)
        setattr(func, ENTER_ATTR, {"snap": snap})
        return func

    return mark


def method(
    func: F | None = None,
    *,
    path: str | None = None,
    stream_flag: str | None = None,
    affinity_field: str | None = None,
    stream_done: bool = False,
) -> Any:
    """Mark a method of a class endpoint as callable at `/{label}/{method}`.

    `path` also serves it at `/{label}/{path}` (e.g. "v1/chat/completions", so that OpenAI
    clients find it under the base URL `/{label}/v1`). `stream_flag` names a boolean
    argument that decides per call whether the answer streams: the method returns an
    iterator (or async iterator) of events when it is true, a JSON value otherwise.
    `affinity_field` names an argument whose value is the call's affinity key when the
    caller sends no `X-Ember-Affinity` header (OpenAI's "prompt_cache_key", a session id).
    `stream_done=True` ends each of its streams with the event `data: [DONE]`, as OpenAI's
    API does (its clients wait for it; Ember's clients skip it).
    """
    if not isinstance(stream_done, bool):
        raise InvalidError(f"@ember.method(stream_done={stream_done!r}): true or false")
    checked_path = None if path is None else _check_path(path)

    def mark(target: F) -> F:
        if not inspect.isfunction(target):
            raise InvalidError(f"@ember.method decorates a method, not {target!r}")
        flag = None if stream_flag is None else _check_stream_flag(target, stream_flag)
        field = (
            None
            if affinity_field is None
            else _check_argument_name(target, "affinity_field", affinity_field)
        )
        options = {
            "path": checked_path,
            "stream_flag": flag,
            "affinity_field": field,
            "stream_done": stream_done,
        }
        setattr(target, METHOD_ATTR, options)
        return target

    return mark if func is None else mark(func)


def exit(func: F | None = None) -> Any:
    """Mark a method to run when a replica stops, after its last input finished."""

    def mark(target: F) -> F:
        _check_hook("exit", target)
        setattr(target, EXIT_ATTR, True)
        return target

    return mark if func is None else mark(func)
