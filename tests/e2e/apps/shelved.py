"""Replicas that keep files in an ember.Volume and read what others put there."""

import ember

shelf = ember.Volume("shelf")


@ember.endpoint(snapshot=False)
def save(path: str, text: str) -> list[str]:
    target = shelf.path / path
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(text)
    return shelf.commit()


@ember.endpoint(snapshot=False)
def read(path: str) -> str | None:
    shelf.reload()
    target = shelf.path / path
    return target.read_text() if target.is_file() else None


@ember.endpoint(snapshot=False)
async def discard(path: str) -> list[str]:
    (shelf.path / path).unlink()
    return await shelf.acommit()


@ember.endpoint(snapshot=False)
def edit_uncommitted(path: str, text: str) -> str:
    """Change the copy's file, reload, and give what the copy then holds."""
    (shelf.path / path).write_text(text)
    shelf.reload()
    return (shelf.path / path).read_text()
