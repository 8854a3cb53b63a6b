"""Replica output tagged by call: whole lines, each behind its call's id, whatever the
threads do at once; the worker's side reads the tag back off."""

from __future__ import annotations

import io
import threading

from ember_worker.replica.call_tagged_output import MARK, CallOfLine, CallTaggedWriter, split_tag


def _writer() -> tuple[CallTaggedWriter, io.StringIO, threading.local]:
    stream, local = io.StringIO(), threading.local()
    return CallTaggedWriter(stream, lambda: getattr(local, "call", None)), stream, local


def test_lines_carry_the_call_that_printed_them_and_others_pass_as_they_are() -> None:
    writer, stream, local = _writer()
    print("before any call", file=writer)  # type: ignore[arg-type]
    local.call = "c-one"
    print("in", "one", file=writer)  # type: ignore[arg-type]
    writer.write("two lines\nat once\n")
    lines = stream.getvalue().splitlines()
    assert [split_tag(line) for line in lines] == [
        (None, "before any call"),
        ("c-one", "in one"),
        ("c-one", "two lines"),
        ("c-one", "at once"),
    ]


def test_a_partial_line_waits_for_its_end_or_a_flush() -> None:
    writer, stream, local = _writer()
    local.call = "c-a"
    writer.write("loading")
    assert stream.getvalue() == ""
    writer.write("... done\npartial")
    assert split_tag(stream.getvalue().splitlines()[0]) == ("c-a", "loading... done")
    writer.flush()
    assert split_tag(stream.getvalue().splitlines()[1]) == ("c-a", "partial")


def test_threads_printing_at_once_never_cut_into_each_others_lines() -> None:
    writer, stream, local = _writer()
    start = threading.Barrier(4)

    def chatter(name: str) -> None:
        local.call = f"c-{name}"
        start.wait()
        for n in range(200):
            writer.write(f"{name} ")
            writer.write(f"line {n}")
            writer.write("\n")

    threads = [threading.Thread(target=chatter, args=(n,)) for n in "wxyz"]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    lines = [split_tag(line) for line in stream.getvalue().splitlines()]
    assert len(lines) == 800
    assert all(call == f"c-{text.split()[0]}" and text.count("line") == 1 for call, text in lines)


def test_what_only_looks_like_a_tag_is_left_as_it_is() -> None:
    assert split_tag(f"{MARK}not-a-call{MARK}text") == (None, f"{MARK}not-a-call{MARK}text")
    assert split_tag(f"{MARK}c-unclosed") == (None, f"{MARK}c-unclosed")
    assert split_tag("plain") == (None, "plain")


def test_the_streams_other_attributes_are_its_own() -> None:
    writer, stream, _ = _writer()
    assert writer.getvalue() == stream.getvalue()  # type: ignore[attr-defined]
    writer.writelines(["a\n", "b\n"])
    assert stream.getvalue() == "a\nb\n"


def test_a_line_of_a_thread_the_code_started_belongs_to_the_one_input_running() -> None:
    local = threading.local()
    call_of_line = CallOfLine(lambda: getattr(local, "call", None))
    stream = io.StringIO()
    writer = CallTaggedWriter(stream, call_of_line)
    running: dict[str, object] = {}
    call_of_line.running = running.keys
    print("booting", file=writer)  # type: ignore[arg-type]
    running["c-one"] = object()
    print("from a helper thread", file=writer)  # type: ignore[arg-type]
    running["c-two"] = object()
    print("whose?", file=writer)  # type: ignore[arg-type]
    local.call = "c-two"
    print("the code's own", file=writer)  # type: ignore[arg-type]
    assert [split_tag(line) for line in stream.getvalue().splitlines()] == [
        (None, "booting"),
        ("c-one", "from a helper thread"),
        (None, "whose?"),  # two run: it could be either's
        ("c-two", "the code's own"),
    ]
