"""`fsdpkit train` (filled in by the engine work)."""

from .app import app


@app.command("train")
def train() -> None:
    """Train a model with fsdpkit's sharded engine."""
    raise SystemExit("not yet")
