"""Fuzzing checkpoint loading: any bytes give loaded weights or a one-line CheckpointError, never code
execution, another exception, or a hang."""

import io

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_fuzz_readers import no_hang

from polytrain.models import build_model
from polytrain.runtime.checkpoint import CheckpointError, load_weights

FUZZ = settings(
    max_examples=200,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
MODEL = build_model("mlp", (1, 8, 8), 3)
buffer = io.BytesIO()
torch.save(MODEL.state_dict(), buffer)
VALID = buffer.getvalue()


def try_load(tmp_path, data: bytes) -> str:
    path = tmp_path / "model.pt"
    path.write_bytes(data)
    model = build_model("mlp", (1, 8, 8), 3)
    with no_hang():
        try:
            load_weights(path, model)
        except CheckpointError as error:
            assert "\n" not in str(error)
            return "refused"
    return "loaded"


@FUZZ
@given(st.binary(max_size=4096))
def test_arbitrary_bytes(tmp_path_factory, data):
    assert try_load(tmp_path_factory.mktemp("f"), data) == "refused"


@FUZZ
@given(
    st.lists(st.tuples(st.integers(0, len(VALID) - 1), st.integers(0, 255)), min_size=1, max_size=8),
    st.integers(0, len(VALID)),
)
def test_mutated_and_truncated_checkpoints(tmp_path_factory, edits, keep):
    data = bytearray(VALID[: max(keep, 1)])
    for position, value in edits:
        if position < len(data):
            data[position] = value
    folder = tmp_path_factory.mktemp("f")
    try_load(folder, bytes(data))
    assert not (folder / "pwned").exists()
