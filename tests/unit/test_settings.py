"""Endpoint settings, the decorators, wire specs and the app loader."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from textwrap import dedent

import pytest

import ember
from ember.declarations.settings import (
    GPU_TYPES,
    EndpointSettings,
    check_name,
    normalize_name,
    parse_gpu,
)
from ember.endpoints.loader import find_endpoints, import_app_file, load_module
from ember.errors import InvalidError
from ember.wire.spec import FUNCTION_METHOD, AppManifest, EndpointSpec, MethodSpec

# --- EndpointSettings --------------------------------------------------------------------


def test_defaults_are_valid() -> None:
    s = EndpointSettings()
    assert s.min_replicas == 0
    assert s.max_replicas >= 1
    assert s.concurrency == 1
    assert s.gpu_choices == ()
    assert s.weights == {}


def test_full_valid_settings() -> None:
    s = EndpointSettings(
        name="chat-v2",
        min_replicas=1,
        max_replicas=8,
        concurrency=16,
        scaledown_window=0,
        timeout=600,
        retries=0,
        gpu="H100:2",
        cpu=4,
        memory=32_768,
        public=True,
        snapshot=False,
        weights={"model": "s3://bucket/llama/", "tokenizer": "https://x/t.json"},
    )
    assert s.gpu_choices == (("H100", 2),)
    assert s.min_replicas == s.max_replicas - 7


def test_min_equal_to_max_is_allowed() -> None:
    assert EndpointSettings(min_replicas=3, max_replicas=3).max_replicas == 3


def test_max_below_min_says_how_to_fix() -> None:
    with pytest.raises(InvalidError) as info:
        EndpointSettings(min_replicas=3, max_replicas=2)
    message = str(info.value)
    assert "max_replicas=2" in message
    assert "min_replicas=3" in message
    assert "raise max_replicas" in message or "lower min_replicas" in message


@pytest.mark.parametrize("value", [0, -1, 10_001])
def test_concurrency_out_of_range(value: int) -> None:
    with pytest.raises(InvalidError, match=r"concurrency=.* out of range; use 1 to"):
        EndpointSettings(concurrency=value)


@pytest.mark.parametrize("value", [True, False, 2.0, 1.5, "4", None])
def test_concurrency_must_be_a_whole_number(value: object) -> None:
    with pytest.raises(InvalidError, match="concurrency must be a whole number"):
        EndpointSettings(concurrency=value)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("min_replicas", -1),
        ("max_replicas", 0),
        ("retries", 11),
        ("memory", 8),
        ("scaledown_window", -1),
        ("timeout", 0),
        ("cpu", 0),
        ("scaledown_window", float("nan")),
        ("timeout", True),
        ("public", 1),
        ("snapshot", "yes"),
        ("buffer_replicas", -1),
        ("buffer_replicas", 1.5),
    ],
)
def test_other_fields_are_checked(field: str, value: object) -> None:
    with pytest.raises(InvalidError, match=field):
        EndpointSettings(**{field: value})  # type: ignore[arg-type]


def test_memory_limit_is_optional_and_at_least_memory() -> None:
    assert EndpointSettings().memory_limit is None
    assert EndpointSettings(memory=512, memory_limit=512).memory_limit == 512
    with pytest.raises(InvalidError, match="memory_limit=256 is below memory=512"):
        EndpointSettings(memory=512, memory_limit=256)
    for bad in ("1G", 1.5, True, 0):
        with pytest.raises(InvalidError, match="memory_limit"):
            EndpointSettings(memory_limit=bad)  # type: ignore[arg-type]
    # Settings stored before the field existed still load.
    stored = EndpointSettings().to_dict()
    del stored["memory_limit"]
    assert EndpointSettings.from_dict(stored).memory_limit is None


def test_requirements_are_pip_lines() -> None:
    assert EndpointSettings().requirements == []
    lines = ["numpy>=2", "./wheels/x.whl", "--extra-index-url https://pkgs.example/simple"]
    assert EndpointSettings(requirements=lines).requirements == lines
    for bad, needle in (
        ("numpy", "must be a list"),
        ([3], "must be a list"),
        ([""], "not one requirement line"),
        (["numpy\nscipy"], "not one requirement line"),
        (["x" * 1001], "not one requirement line"),
        (["six"] * 201, "at most 200"),
    ):
        with pytest.raises(InvalidError, match=needle):
            EndpointSettings(requirements=bad)  # type: ignore[arg-type]
    stored = EndpointSettings().to_dict()
    del stored["requirements"]
    assert EndpointSettings.from_dict(stored).requirements == []


def test_cpu_limit_is_optional_and_at_least_cpu() -> None:
    assert EndpointSettings().cpu_limit is None
    assert EndpointSettings(cpu=0.5, cpu_limit=2).cpu_limit == 2
    with pytest.raises(InvalidError, match=r"cpu_limit=0\.25 is below cpu=1"):
        EndpointSettings(cpu=1, cpu_limit=0.25)
    for bad in ("2", True, 0, 1000):
        with pytest.raises(InvalidError, match="cpu_limit"):
            EndpointSettings(cpu_limit=bad)  # type: ignore[arg-type]
    stored = EndpointSettings().to_dict()
    del stored["cpu_limit"]
    assert EndpointSettings.from_dict(stored).cpu_limit is None


# --- GPUs ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("gpu", "expected"),
    [
        (None, (None, 0)),
        ("H100", ("H100", 1)),
        ("h100", ("H100", 1)),
        (" H100 ", ("H100", 1)),
        ("H100:2", ("H100", 2)),
        ("a100-80gb:8", ("A100-80GB", 8)),
        ("H200:1", ("H200", 1)),
        # Aliases: what nvidia-smi shows.
        ("A100-40GB", ("A100", 1)),
        ("H100-80GB:4", ("H100", 4)),
        ("A10", ("A10G", 1)),
    ],
)
def test_parse_gpu_valid(gpu: str | None, expected: tuple[str | None, int]) -> None:
    assert parse_gpu(gpu) == expected
    settings = EndpointSettings(gpu=gpu)
    assert settings.gpu_choices == (() if gpu is None else (expected,))


def test_gpu_choices_in_order_of_preference() -> None:
    assert EndpointSettings().gpu_choices == ()
    assert EndpointSettings(gpu="h100:2").gpu_choices == (("H100", 2),)
    settings = EndpointSettings(gpu=["H100", "a100-80gb:2"])
    assert settings.gpu_choices == (("H100", 1), ("A100-80GB", 2))
    for bad, message in [
        ([], "1 to 8 GPU types"),
        (["H100"] * 9, "1 to 8 GPU types"),
        (["H100", "h100:2"], "names a GPU type twice"),
        (["H100", "TPU"], "unknown GPU type 'TPU'"),
        (["H100", 3], "is not a GPU type"),
    ]:
        with pytest.raises(InvalidError, match=message):
            EndpointSettings(gpu=bad)  # type: ignore[arg-type]


def test_unknown_gpu_lists_valid_names() -> None:
    with pytest.raises(InvalidError) as info:
        EndpointSettings(gpu="H1000")
    message = str(info.value)
    assert "unknown GPU type 'H1000'" in message
    for name in GPU_TYPES:
        assert name in message
    assert "'H100:2'" in message  # how to ask for several


@pytest.mark.parametrize("gpu", ["H100:0", "H100:x", "H100:9", "H100:-1", "H100:1.5"])
def test_bad_gpu_count(gpu: str) -> None:
    with pytest.raises(InvalidError, match="count after ':' must be 1 to 8"):
        parse_gpu(gpu)


def test_gpu_count_with_non_ascii_digit_is_invalid_error() -> None:
    with pytest.raises(InvalidError, match="count"):
        parse_gpu("H100:²")


@pytest.mark.parametrize("gpu", ["", "   ", 1, ["H100"]])
def test_gpu_not_a_string(gpu: object) -> None:
    with pytest.raises(InvalidError, match=r"gpu=.*write e\.g\. gpu='H100'"):
        parse_gpu(gpu)  # type: ignore[arg-type]


# --- names -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["a", "echo", "chat-v2", "0abc9", "a" * 48, "a-b-c"])
def test_good_names(name: str) -> None:
    assert check_name("endpoint", name) == name
    assert EndpointSettings(name=name).name == name


@pytest.mark.parametrize(
    "name",
    ["Echo", "ECHO", "a--b", "a" * 49, "-a", "a-", "a_b", "a.b", "", "é", "a b", 5, "notes\n"],
)
def test_bad_names(name: object) -> None:
    with pytest.raises(InvalidError) as info:
        EndpointSettings(name=name)  # type: ignore[arg-type]
    message = str(info.value)
    assert "not allowed" in message
    assert "lower-case" in message
    assert "1-48" in message
    assert "single hyphens" in message


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("MyModel_v2", "mymodel-v2"),
        ("echo", "echo"),
        ("__private__", "private"),
        ("Chat__Model", "chat-model"),
        ("HTTPServer2", "httpserver2"),
    ],
)
def test_normalize_name(raw: str, expected: str) -> None:
    assert normalize_name(raw) == expected


# --- weights -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "weights",
    [{"model": 1}, {1: "s3://b/m"}, ["s3://b/m"], "s3://b/m", {"m": None}],
)
def test_weights_must_map_str_to_str(weights: object) -> None:
    with pytest.raises(InvalidError) as info:
        EndpointSettings(weights=weights)  # type: ignore[arg-type]
    assert "weights must map names to URLs" in str(info.value)
    assert "weights={'model':" in str(info.value)


@pytest.mark.parametrize("weights", [{"model": 1}, {1: "s3://b/m"}])
def test_decorator_rejects_bad_weights_dicts(weights: object) -> None:
    with pytest.raises(InvalidError, match="weights must map"):
        ember.endpoint(weights=weights)  # type: ignore[arg-type]


@pytest.mark.parametrize("weights", ["s3://bucket/model/", 5])
def test_decorator_rejects_non_dict_weights_with_invalid_error(weights: object) -> None:
    with pytest.raises(InvalidError, match="weights must map"):
        ember.endpoint(weights=weights)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("weights", "message"),
    [
        ({"model": "ftp://host/m.safetensors"}, "use an s3://, https://, http:// or file://"),
        ({"model": "s3://bucket"}, "names a bucket and a key or a prefix"),
        ({"model": "s3:///key"}, "names a bucket and a key or a prefix"),
        ({"model": "https:///m.safetensors"}, "has no host"),
        ({"model": "file://relative/m.safetensors"}, "needs an absolute path"),
        ({"my-model": "s3://b/m.safetensors"}, "is not a valid name"),
    ],
)
def test_weights_urls_are_checked(weights: dict[str, str], message: str) -> None:
    with pytest.raises(InvalidError, match=message):
        EndpointSettings(weights=weights)


def test_weights_urls_that_are_fine() -> None:
    urls = {
        "single": "s3://bucket/models/m.safetensors",
        "sharded": "s3://bucket/llama/",
        "web": "https://host/m.safetensors",
        "local": "file:///srv/m.safetensors",
    }
    assert EndpointSettings(weights=urls, s3_endpoint_url="http://127.0.0.1:9000").weights == urls


@pytest.mark.parametrize("endpoint_url", ["127.0.0.1:9000", "s3://x", 5])
def test_s3_endpoint_url_must_be_http(endpoint_url: object) -> None:
    with pytest.raises(InvalidError, match="must be an http"):
        EndpointSettings(s3_endpoint_url=endpoint_url)  # type: ignore[arg-type]


# --- the decorators: misuse ------------------------------------------------------------


def test_endpoint_without_parentheses() -> None:
    with pytest.raises(InvalidError) as info:

        @ember.endpoint  # type: ignore[arg-type]
        def echo(text: str) -> str:
            return text

    message = str(info.value)
    assert "parentheses" in message
    assert "@ember.endpoint()" in message


def test_endpoint_settings_checked_when_decorator_runs() -> None:
    with pytest.raises(InvalidError, match="max_replicas"):
        ember.endpoint(min_replicas=5, max_replicas=1)


def test_enter_without_parentheses() -> None:
    with pytest.raises(InvalidError) as info:

        class Model:
            @ember.enter  # type: ignore[arg-type]
            def load(self) -> None:
                pass

    message = str(info.value)
    assert "parentheses" in message
    assert "@ember.enter()" in message


def test_enter_snap_must_be_bool() -> None:
    with pytest.raises(InvalidError, match="True or False"):
        ember.enter(snap="yes")  # type: ignore[arg-type]


def test_enter_hook_cannot_be_a_generator() -> None:
    with pytest.raises(InvalidError) as info:

        class Model:
            @ember.enter(snap=True)
            def load(self):  # type: ignore[no-untyped-def]
                yield 1

    message = str(info.value)
    assert "generator" in message
    assert "cannot stream" in message
    assert "@ember.method" in message


def test_enter_hook_cannot_be_an_async_generator() -> None:
    with pytest.raises(InvalidError, match="cannot stream"):

        class Model:
            @ember.enter()
            async def ready(self):  # type: ignore[no-untyped-def]
                yield 1


@pytest.mark.parametrize("with_parentheses", [False, True])
def test_exit_hook_cannot_be_a_generator(with_parentheses: bool) -> None:
    def close(self):  # type: ignore[no-untyped-def]
        yield None

    marker = ember.exit() if with_parentheses else ember.exit
    with pytest.raises(InvalidError, match=r"@ember\.exit hooks cannot stream"):
        marker(close)


@pytest.mark.parametrize("marker", [ember.enter(), ember.exit, ember.method])
def test_markers_reject_non_functions(marker) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(InvalidError, match="decorates a method"):
        marker(42)


def test_class_without_methods() -> None:
    with pytest.raises(InvalidError) as info:

        @ember.endpoint()
        class Model:
            @ember.enter()
            def load(self) -> None:
                pass

            def generate(self) -> None:  # not marked
                pass

    message = str(info.value)
    assert "Model" in message
    assert "no methods" in message
    assert "@ember.method" in message


@pytest.mark.parametrize(
    "init_source",
    [
        "def __init__(self, path): pass",
        "def __init__(self, *, path): pass",
        "def __init__(self, a, b=1, *args, **kwargs): pass",
    ],
)
def test_class_init_with_required_arguments(init_source: str) -> None:
    namespace: dict[str, object] = {}
    exec(init_source, namespace)
    cls = type(
        "Model",
        (),
        {"__init__": namespace["__init__"], "run": ember.method(lambda self: None)},
    )
    with pytest.raises(InvalidError) as info:
        ember.endpoint()(cls)
    message = str(info.value)
    assert "__init__" in message
    assert "required arguments" in message
    assert "@ember.enter()" in message


def test_class_init_with_optional_arguments_is_fine() -> None:
    @ember.endpoint()
    class Model:
        def __init__(self, size: int = 3, *args: object, **kwargs: object) -> None:
            self.size = size

        @ember.method
        def run(self) -> int:
            return self.size

    assert Model().run() == 3


def test_inherited_init_with_required_arguments() -> None:
    class Base:
        def __init__(self, path: str) -> None:
            self.path = path

    with pytest.raises(InvalidError, match="__init__"):

        @ember.endpoint()
        class Model(Base):
            @ember.method
            def run(self) -> str:
                return self.path


def test_decorating_twice() -> None:
    with pytest.raises(InvalidError, match="twice"):

        @ember.endpoint()
        @ember.endpoint()
        def echo() -> None:
            pass


@pytest.mark.parametrize("target", [42, "echo", len, object()])
def test_decorating_a_non_function(target: object) -> None:
    with pytest.raises(InvalidError, match="decorates a function or a class"):
        ember.endpoint()(target)  # type: ignore[arg-type]


def test_name_that_normalizes_to_nothing() -> None:
    def _() -> None:
        pass

    with pytest.raises(InvalidError, match="name="):
        ember.endpoint()(_)


def test_derived_name_too_long_is_rejected_at_decoration() -> None:
    def long_function_name_that_goes_well_beyond_the_limit_of_labels() -> None:
        pass

    with pytest.raises(InvalidError, match="name"):
        ember.endpoint()(long_function_name_that_goes_well_beyond_the_limit_of_labels)


# --- the decorators: what they collect -------------------------------------------------


def test_name_derived_from_function_and_class() -> None:
    @ember.endpoint()
    def MyModel_v2() -> None:
        pass

    @ember.endpoint()
    class Chat_Model:
        @ember.method
        def run(self) -> None:
            pass

    assert MyModel_v2.name == "mymodel-v2"
    assert Chat_Model.name == "chat-model"
    assert MyModel_v2.kind == "function"
    assert Chat_Model.kind == "class"


def test_explicit_name_wins_and_is_checked() -> None:
    @ember.endpoint(name="custom")
    def echo() -> None:
        pass

    assert echo.name == "custom"
    with pytest.raises(InvalidError, match="not allowed"):
        ember.endpoint(name="Bad--Name")


def test_function_endpoint_methods() -> None:
    @ember.endpoint()
    def plain(x: int) -> int:
        return x

    @ember.endpoint()
    def gen(n: int):  # type: ignore[no-untyped-def]
        yield from range(n)

    @ember.endpoint()
    async def coro() -> int:
        return 1

    @ember.endpoint()
    async def agen():  # type: ignore[no-untyped-def]
        yield 1

    expected = {
        plain: (False, False, {"x": "int"}),
        gen: (True, False, {"n": "int"}),
        coro: (False, True, {}),
        agen: (True, True, {}),
    }
    for definition, (streaming, is_async, parameters) in expected.items():
        assert definition.methods == {
            FUNCTION_METHOD: MethodSpec(FUNCTION_METHOD, streaming, is_async, parameters=parameters)
        }
        assert definition.enter_hooks == []
        assert definition.exit_hooks == []


class _Base:
    @ember.method
    def inherited(self) -> str:
        return "base"


@ember.endpoint(gpu="H100", weights={"model": "s3://bucket/m/"})
class _Chat(_Base):
    def __init__(self) -> None:
        self.calls: list[str] = []

    @ember.enter()
    def a_ready(self) -> None:
        self.calls.append("ready")

    @ember.enter(snap=True)
    def b_load(self) -> None:
        self.calls.append("load")

    @ember.enter(snap=True)
    def c_compile(self) -> None:
        self.calls.append("compile")

    @ember.enter()
    def d_reseed(self) -> None:
        self.calls.append("reseed")

    @ember.method
    def sync(self, x: int) -> int:
        return x * 2

    @ember.method()
    def stream(self, n: int):  # type: ignore[no-untyped-def]
        yield from range(n)

    @ember.method
    async def coro(self) -> int:
        return 1

    @ember.method
    async def agen(self):  # type: ignore[no-untyped-def]
        yield 1

    def helper(self) -> None:  # not a method of the endpoint
        pass

    @ember.exit
    def close(self) -> None:
        self.calls.append("close")

    @ember.exit()
    def flush(self) -> None:
        pass


def test_class_methods_collected_with_flags() -> None:
    assert _Chat.methods == {
        "sync": MethodSpec("sync", streaming=False, is_async=False, parameters={"x": "int"}),
        "stream": MethodSpec("stream", streaming=True, is_async=False, parameters={"n": "int"}),
        "coro": MethodSpec("coro", streaming=False, is_async=True),
        "agen": MethodSpec("agen", streaming=True, is_async=True),
        "inherited": MethodSpec("inherited", streaming=False, is_async=False),
    }


def test_enter_hooks_snap_first_then_others() -> None:
    # Alphabetically a_ready would come first; snap hooks must run before any other.
    assert _Chat.enter_hooks == [
        ("b_load", True),
        ("c_compile", True),
        ("a_ready", False),
        ("d_reseed", False),
    ]
    snaps = [snap for _, snap in _Chat.enter_hooks]
    assert snaps == sorted(snaps, reverse=True)
    assert sorted(_Chat.exit_hooks) == ["close", "flush"]


def test_definition_is_still_callable_locally() -> None:
    @ember.endpoint()
    def echo(text: str, times: int = 1) -> dict:
        return {"text": text * times}

    assert echo("ab", times=2) == {"text": "abab"}
    instance = _Chat()
    assert isinstance(instance, _Chat.target)
    assert instance.sync(4) == 8
    assert list(instance.stream(3)) == [0, 1, 2]
    assert instance.inherited() == "base"
    assert "echo" in repr(echo)


def test_settings_carried_by_definition() -> None:
    assert _Chat.settings.gpu_choices == (("H100", 1),)
    assert _Chat.settings.weights == {"model": "s3://bucket/m/"}


def test_decorator_copies_weights() -> None:
    weights = {"model": "s3://a/"}

    @ember.endpoint(weights=weights)
    def f() -> None:
        pass

    weights["model"] = "s3://changed/"
    assert f.settings.weights == {"model": "s3://a/"}


# --- round trips -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "settings",
    [
        EndpointSettings(),
        EndpointSettings(
            name="chat",
            min_replicas=1,
            max_replicas=2,
            concurrency=8,
            scaledown_window=0.5,
            gpu="h100:2",
            cpu=2.5,
            memory=2048,
            public=True,
            snapshot=False,
            weights={"model": "s3://b/m/"},
        ),
    ],
)
def test_settings_round_trip(settings: EndpointSettings) -> None:
    assert EndpointSettings.from_dict(settings.to_dict()) == settings
    wire = json.loads(json.dumps(settings.to_dict()))
    assert EndpointSettings.from_dict(wire) == settings


def test_settings_from_dict_ignores_unknown_keys_and_validates() -> None:
    data = EndpointSettings().to_dict() | {"future_option": 1}
    assert EndpointSettings.from_dict(data) == EndpointSettings()
    with pytest.raises(InvalidError):
        EndpointSettings.from_dict({"concurrency": 0})


def test_app_manifest_round_trip() -> None:
    @ember.endpoint(concurrency=4)
    def echo(text: str) -> str:
        return text

    manifest = AppManifest(
        app="demo",
        entry="pkg/app.py",
        endpoints=[echo.spec("echo"), _Chat.spec("_Chat")],
    )
    data = json.loads(json.dumps(manifest.to_dict()))
    restored = AppManifest.from_dict(data)
    assert restored == manifest
    assert restored.endpoints[1].methods["stream"].streaming is True
    assert restored.endpoints[1].settings.gpu_choices[0][1] == 1
    assert [e.name for e in restored.endpoints] == ["echo", "chat"]
    assert EndpointSpec.from_dict(manifest.endpoints[0].to_dict()) == manifest.endpoints[0]


# --- loader ----------------------------------------------------------------------------


def _load(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stem: str, source: str):  # type: ignore[no-untyped-def]
    path = tmp_path / f"{stem}.py"
    path.write_text(dedent(source))
    # load_module registers the module and puts its folder on sys.path: undo both.
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setitem(sys.modules, stem, None)  # type: ignore[arg-type]
    return load_module(path)


def test_find_endpoints_in_definition_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    module = _load(
        tmp_path,
        monkeypatch,
        "ember_unit_app_ok",
        """
        import ember

        @ember.endpoint()
        def zeta(x: int) -> int:
            return x

        helper = 3

        @ember.endpoint(name="alpha")
        class Model:
            @ember.method
            def run(self) -> None:
                pass
        """,
    )
    found = find_endpoints(module)
    assert list(found) == ["zeta", "Model"]
    assert found["Model"].name == "alpha"


def test_find_endpoints_duplicate_names(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    module = _load(
        tmp_path,
        monkeypatch,
        "ember_unit_app_dup",
        """
        import ember

        @ember.endpoint()
        def echo(text: str) -> str:
            return text

        @ember.endpoint(name="echo")
        def shout(text: str) -> str:
            return text.upper()
        """,
    )
    with pytest.raises(InvalidError) as info:
        find_endpoints(module)
    message = str(info.value)
    assert "echo" in message
    assert "shout" in message
    assert "name=" in message


def test_another_name_for_an_endpoint_is_the_same_endpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    module = _load(
        tmp_path,
        monkeypatch,
        "ember_unit_app_alias",
        """
        import ember

        @ember.endpoint()
        def echo(text: str) -> str:
            return text

        alias = echo
        """,
    )
    assert list(find_endpoints(module)) == ["echo"]


def _import_app(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, files: dict[str, str]) -> str:
    """import_app_file's error for an app of these files, the first one its entry."""
    for name, source in files.items():
        (tmp_path / name).write_text(dedent(source))
    monkeypatch.setattr(sys, "path", list(sys.path))
    for name in files:
        monkeypatch.delitem(sys.modules, Path(name).stem, raising=False)
    with pytest.raises(InvalidError) as info:
        import_app_file(tmp_path / next(iter(files)))
    return str(info.value)


def test_a_syntax_error_says_where_without_embers_frames(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    entry = tmp_path / "ember_unit_syntax.py"
    message = _import_app(tmp_path, monkeypatch, {entry.name: "import ember\ndef f(:\n"})
    assert message.startswith(f"cannot import {entry}:\n")
    assert f'File "{entry}", line 2' in message and "SyntaxError" in message
    assert "Traceback" not in message and "loader.py" not in message


def test_an_import_time_error_shows_the_users_frames_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    files = {
        "ember_unit_entry.py": "import ember_unit_helper\n",
        "ember_unit_helper.py": """
        def fail():
            raise ValueError("no model file")

        fail()
        """,
    }
    message = _import_app(tmp_path, monkeypatch, files)
    lines = message.splitlines()
    assert lines[1] == "Traceback (most recent call last):"
    assert f'File "{tmp_path / "ember_unit_entry.py"}", line 1, in <module>' in lines[2]
    assert lines[-1] == "ValueError: no model file"
    assert "in fail" in message
    assert "loader.py" not in message and "importlib" not in message


def test_load_module_rejects_non_python(tmp_path: Path) -> None:
    text = tmp_path / "app.txt"
    text.write_text("x = 1\n")
    with pytest.raises(InvalidError, match="not a Python file"):
        load_module(text)
    with pytest.raises(InvalidError, match="not a Python file"):
        load_module(tmp_path / "missing.py")


# --- @ember.method(path=..., stream_flag=...) ----------------------------------------------


def test_method_path_and_stream_flag_reach_the_spec() -> None:
    @ember.endpoint()
    class Chat:
        @ember.method(path="/v1/chat/completions/", stream_flag="stream")
        def completions(self, messages: list, stream: bool = False) -> object:
            return iter([]) if stream else {}

    spec = Chat.methods["completions"]
    assert spec.path == "v1/chat/completions"  # outer slashes dropped
    assert spec.stream_flag == "stream"
    assert spec.streams({"stream": True}) and not spec.streams({"stream": "yes"})
    assert not spec.streams({})
    endpoint = Chat.spec("Chat")  # its methods with their schemas: equal, not the same
    assert endpoint.method_at("v1/chat/completions") == spec
    assert endpoint.method_at("completions") == spec
    assert endpoint.method_at("v1/chat") is None
    assert MethodSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec
    # Specs without the new fields (apps deployed before them) still load.
    assert MethodSpec.from_dict({"name": "m", "streaming": True, "is_async": False}).streams({})


@pytest.mark.parametrize("path", ["", "/", "a//b", "v1/../x", "v1/chat?x=1", "a b", 7])
def test_bad_method_paths(path: object) -> None:
    with pytest.raises(InvalidError, match="path"):
        ember.method(path=path)  # type: ignore[arg-type]


def test_stream_flag_is_checked() -> None:
    def gen(self, stream: bool = False):  # type: ignore[no-untyped-def]
        yield 1

    def no_flag(self) -> dict:
        return {}

    def with_kwargs(self, **options: object) -> dict:
        return {}

    with pytest.raises(InvalidError, match="not be a generator"):
        ember.method(stream_flag="stream")(gen)
    with pytest.raises(InvalidError, match="no argument 'stream'"):
        ember.method(stream_flag="stream")(no_flag)
    with pytest.raises(InvalidError, match="name of an argument"):
        ember.method(stream_flag="not an identifier")(no_flag)
    ember.method(stream_flag="stream")(with_kwargs)  # **kwargs can take it


def test_an_affinity_field_reaches_the_spec_and_is_checked() -> None:
    @ember.endpoint()
    class Chat:
        @ember.method(affinity_field="session")
        def reply(self, text: str, session: str | None = None) -> str:
            return text

    spec = Chat.methods["reply"]
    assert spec.affinity_field == "session"
    assert MethodSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec

    def no_session(self, text: str) -> str:
        return text

    with pytest.raises(InvalidError, match="no argument 'session'"):
        ember.method(affinity_field="session")(no_session)
    with pytest.raises(InvalidError, match="affinity_field is the name of an argument"):
        ember.method(affinity_field="a-b")(no_session)


def test_a_path_cannot_be_taken_twice() -> None:
    with pytest.raises(InvalidError, match="already the URL of"):

        @ember.endpoint()
        class Twice:
            @ember.method(path="v1/run")
            def a(self) -> None: ...

            @ember.method(path="v1/run")
            def b(self) -> None: ...

    with pytest.raises(InvalidError, match="already the URL of"):

        @ember.endpoint()
        class ShadowsAName:
            @ember.method(path="b")
            def a(self) -> None: ...

            @ember.method
            def b(self) -> None: ...


def test_stream_flag_and_batching_do_not_mix() -> None:
    with pytest.raises(InvalidError, match="do not mix"):

        @ember.endpoint(concurrency=4)
        class Both:
            @ember.method(stream_flag="stream")
            @ember.batched(max_batch_size=4, wait_ms=5)
            def run(self, items: list, stream: bool = False) -> list:
                return items


def test_env_variables_are_checked_when_the_decorator_runs() -> None:
    assert EndpointSettings(env={"HF_HOME": "/cache", "MODE": ""}).env == {
        "HF_HOME": "/cache",
        "MODE": "",
    }
    for bad, said in (
        ({"EMBER_TOKEN": "x"}, "are Ember's own"),
        ({"1X": "y"}, "is not an environment variable name"),
        ({"A": 1}, "must be text"),
        ({"A": "x" * (64 * 1024 + 1)}, "at most 65536"),
        (["A=1"], "env must map variable names to values"),
    ):
        with pytest.raises(InvalidError, match=said):
            ember.endpoint(env=bad)  # type: ignore[arg-type]


def test_an_endpoint_s_body_limit_is_checked() -> None:
    assert EndpointSettings(max_body_mb=32).max_body_mb == 32
    assert EndpointSettings().max_body_mb is None  # the server's limit
    for bad in (0, 49, "8", True):
        with pytest.raises(InvalidError, match="max_body_mb"):
            EndpointSettings(max_body_mb=bad)  # type: ignore[arg-type]
